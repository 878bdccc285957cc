"""Context parallelism across ranks (spec section 8): ``chunk_kda(..., cp_group=group)`` with
every rank of ``group`` holding its contiguous slice of the tokens of the same B sequences
(rank r: tokens ``[r T_local, (r + 1) T_local)`` of each, T_local the same on every rank).

The state after a run of tokens is affine in the state before it, ``S_after = P S_before + R``
(``reference.segment_transition``). Each rank

1. finds its own ``(P, R)`` with the chunk kernels themselves: R is the final state of its
   tokens run from a zero state, P the final states of its tokens with v = 0 run from the
   columns of the identity (``ceil(K / V)`` runs: each state holds V columns of P);
2. all-gathers every rank's ``(P, R)`` and the first rank's initial state in the full state
   dtype (float32, or float64 for float64 inputs: ``validation.STATE_DTYPES``; one collective:
   ``K x K + 2 K x V`` per sequence and value head);
3. folds the earlier ranks' transitions into its initial state and runs its tokens.

Every rank returns its tokens' outputs and the final state of the whole sequence (folded from
every rank's transition: the same on every rank). The initial state is the first rank's:
pass it on every rank or on none (its value on other ranks is ignored).

Backward: with inputs that require grad the three steps run under autograd, the all-gather
through ``torch.distributed.nn.functional`` (differentiable: its backward sums every rank's
gradient of each transition, and of the initial state, back to the rank it came from). So a
loss on rank r's outputs reaches the inputs of every rank before it through the chain of
states (the reverse chain), and each rank's backward runs its chunk kernels' own backward.
One collective carries the initial state too: with a separate differentiable broadcast the
gradients of the earlier ranks' inputs came out 3% off on gloo (2026-12-01), most likely
because each rank's autograd orders the two backward collectives by its own graph, so they
can pair up with the wrong partners. The final state is every rank's: a loss that uses it
on several ranks counts it once per rank. Every rank must run backward (the collectives of
the backward pair up across ranks).

Packed sequences (``cu_seqlens``): see :func:`_packed`. There the initial state is read on
every rank (pass the same one everywhere): row n on each rank holding a piece of sequence n,
so its gradient is the sum of those ranks' (all-reduce it, as for A_log); a final state
carries its gradient from the rank where its sequence ends (the other ranks receive it
through a sum that autograd does not record).

fla's ``cp_context`` (``fla.ops.cp.build_cp_context``, contiguous layout) is taken too:
:func:`from_fla_cp_context` turns its local offsets and first/last-rank flags into the
whole batch's ``cu_seqlens`` (one small all-gather) and runs the packed path; unlike fla,
``initial_state`` and ``output_final_state`` work with it (fla's local offsets drop
sequences of no tokens, so N counts only the others). Its zigzag layout (two intervals per
rank) is refused. Collectives run on the group's own timeout.

Arguments: every rank checks its own as an ordinary call's (:func:`check_local`) before any
collective, and the first collective carries whether it refused them, the shapes, a digest of
the offsets and ``output_final_state``: a refusal or a difference raises on every rank, and the
ranks' collectives stay paired.
"""

from __future__ import annotations

import array
import hashlib

import torch
import torch.distributed as dist

from kda import validation
from kda.transitions import affine_transitions, kv_layout
from kda.validation import IGNORED_KWARGS, STATE_DTYPES


def check_local(q, k, v, g, beta, kw: dict) -> None:
    """This rank's arguments, checked as an ordinary call's (``validation.check_problem``): batched,
    the call itself; packed, its tensors as one sequence (B = 1), then the whole batch's offsets
    (their end is checked against every rank's tokens, after the first collective) and an
    initial state of their N sequences. Until a review of 2026-12-07 nothing was checked here:
    bad offsets gave wrong answers, and other bad arguments raised raw errors on one rank while
    the others waited in a collective."""
    from kda.api import CALL_PARAMETERS

    extras = {name: x for name, x in kw.items() if name not in CALL_PARAMETERS}
    packed = kw.get("cu_seqlens") is not None
    h0 = kw.get("initial_state")
    args = dict(kw, q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=None, cu_seqlens_cpu=None)
    if packed:
        args["initial_state"] = None
    problem = validation.check_chunk_kda(args, extras)
    if not packed:
        return
    cu, _, offsets = validation._check_cu_seqlens(kw["cu_seqlens"], kw.get("cu_seqlens_cpu"), problem.B, None, q.device)
    if offsets is None:  # left unchecked on the device (KDA_CHECK_CU_SEQLENS=0): the ranks read them all the same
        offsets = validation._check_cu_seqlens(cu.cpu(), None, 1, None, torch.device("cpu"))[2]
    validation.check_graph_offsets(extras, len(offsets) - 1)
    if h0 is not None:
        dims = (len(offsets) - 1, problem.HV, problem.K, problem.V)
        validation.check_initial_state(h0, dims, problem.state_v_first, problem.q.dtype, q.device)


# The first collective's message, a fixed length on every rank (a rank without offsets sent 3
# entries fewer and gloo aborted the process: a review of 2026-12-07): whether the rank refused
# its arguments, then what must agree, then its token count.
_FINGERPRINT = ("refused", "B", "H", "K", "HV", "V", "packed", "N + 1", "end", "hash", "hash",
                "output_final_state", "state bits", "T_local")  # fmt: skip


def _offsets_hash(cu: list[int]) -> list[int]:
    """Two int64 words of a digest of the offsets: (length, end, weighted sum) let different
    offsets pass as the same (a review of 2026-12-07: [0, 10, 20, 30] and [0, 12, 19, 30])."""
    digest = hashlib.blake2b(array.array("q", cu).tobytes(), digest_size=16).digest()
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]


def _check(group, q, v, kw: dict, refusal: Exception | None) -> tuple[int, int, list[int]]:
    """The group, and the ranks' agreement in one all-gather: a rank that refused its arguments
    (``refusal``, from :func:`check_local`) makes every rank raise, and so does any difference in
    the shapes, the offsets or output_final_state. Returns the rank, the world size and every
    rank's T_local."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("`cp_group` needs an initialised torch.distributed process group")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"`cp_group` is not a usable process group: {err}") from None
    if rank < 0:
        raise ValueError("`cp_group`: this process is not a member of the group")
    fingerprint = [1] + [0] * (len(_FINGERPRINT) - 1)
    if refusal is None:
        cu = _host_offsets(kw)
        B, T, H, K = q.shape
        described = [0, 0, 0, 0, 0] if cu is None else [1, len(cu), cu[-1], *_offsets_hash(cu)]
        bits = torch.finfo(STATE_DTYPES[q.dtype][0]).bits
        fingerprint = [0, B, H, K, *v.shape[2:], *described, bool(kw.get("output_final_state")), bits, T]
    shape = torch.tensor(fingerprint, dtype=torch.int64, device=_device(group, q))
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    refused = [r for r, s in enumerate(shapes) if s[0]]
    if refusal is not None:
        raise refusal
    if refused:
        raise ValueError(f"`cp_group`: rank {', '.join(map(str, refused))} refused its arguments (its error says "
                         "why); no rank ran")  # fmt: skip
    fixed = slice(None, -1) if cu is not None else slice(None)  # packed slices may differ in length
    if any(not torch.equal(s[fixed], shapes[0][fixed]) for s in shapes):
        what = "(B, H, K, HV, V, cu_seqlens, output_final_state, state dtype)"
        if cu is None:
            what = what.replace("cu_seqlens", "T_local")
        raise ValueError(f"`cp_group`: the ranks' slices differ in shape {what}: {[s.tolist() for s in shapes]}")
    lengths = [int(s[-1]) for s in shapes]
    if cu is not None and sum(lengths) != cu[-1]:
        raise ValueError(f"`cp_group`: the ranks hold {sum(lengths)} tokens in all ({lengths}), but `cu_seqlens` "
                         f"describes {cu[-1]}")  # fmt: skip
    return rank, world, lengths


def _host_offsets(kw: dict) -> list[int] | None:
    """The packed batch's offsets (``cu_seqlens``) as Python ints, or None when batched."""
    cu = kw.get("cu_seqlens")
    if cu is None:
        return None
    host = kw.get("cu_seqlens_cpu")
    return (host if host is not None else cu).tolist()


def _device(group, like) -> torch.device:
    """Where the group's collectives take tensors: the inputs' device for NCCL (the current CUDA
    device when ``like`` is not a tensor: a refused argument), the CPU for gloo."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return like.device if isinstance(like, torch.Tensor) else torch.device("cuda", torch.cuda.current_device())


def _agree(group, world: int, device, has_h0: bool, training: bool) -> tuple[int, int]:
    """How many ranks pass an initial state and how many train (one all-reduce); either must be
    all of them or none, or the ranks' collectives would not pair up (a hang, or wrong data)."""
    counts = torch.tensor([has_h0, training], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    with_h0, trainers = (int(c) for c in counts.tolist())
    if with_h0 not in (0, world):
        raise ValueError("`cp_group`: pass `initial_state` on every rank or on none")
    if trainers not in (0, world):
        raise ValueError("`cp_group`: inputs require grad on some ranks and not on others; the backward's "
                         "collectives pair up across ranks, so every rank trains or none does")  # fmt: skip
    return with_h0, trainers


def _gather(x: torch.Tensor, group, world: int, trainers: int) -> list[torch.Tensor]:
    """Every rank's ``x``: a differentiable all-gather when the ranks train (its backward sums
    each rank's gradient of every entry back to the rank it came from), else a plain one."""
    if not trainers:
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x, group=group)
        return every
    import warnings

    from torch.distributed.nn import functional as dist_autograd

    if not x.requires_grad:
        # This rank's part needs no gradient (say only the first rank's initial state trains),
        # but the gather must still be recorded, or this rank's backward would skip the
        # collective the others wait in.
        x = x.detach().requires_grad_()
    with warnings.catch_warnings():
        # torch 2.13 marks it deprecated in favour of the private functional collectives
        # (torch.distributed._functional_collectives, whose names changed between 2.11 and
        # 2.13); this public one runs on gloo too (off NCCL its backward is an all-to-all).
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather is deprecated")
        return list(dist_autograd.all_gather(x, group=group))


def chunk_kda_context_parallel(chunk_kda, group, q, k, v, g, beta, kw: dict, refusal: Exception | None = None):
    """``chunk_kda(q, k, v, g, beta, **kw)`` on this rank's slice of the tokens; see the module.
    ``refusal``: the caller's own refusal of this rank's arguments, raised on every rank."""
    if refusal is None:
        try:
            check_local(q, k, v, g, beta, kw)
        except (ValueError, TypeError) as err:
            refusal = err
    rank, world, lengths = _check(group, q, v, kw, refusal)
    B, _, _, K = q.shape
    v_first = bool(kw.get("state_v_first", False))
    h0 = kw.pop("initial_state", None)
    want_final = bool(kw.pop("output_final_state", False))
    device = _device(group, q)
    if kw.get("cu_seqlens") is not None:
        return _packed(chunk_kda, group, rank, world, lengths, q, k, v, g, beta, h0, want_final, kw)
    # 1. this rank's transition, in the full state dtype, KV layout
    full = STATE_DTYPES[q.dtype][0]
    P, R = affine_transitions(chunk_kda, q, k, v, g, beta, kw, B)
    as_kv, from_kv = kv_layout(v_first)

    # 2. every rank's transition and the first rank's initial state, in one all-gather
    # (differentiable when autograd records: the gradients go back to the ranks they came
    # from; one collective, so every rank's backward runs the same collectives in the same order)
    training = torch.is_grad_enabled() and (
        any(x.requires_grad for x in (P, R)) or (h0 is not None and h0.requires_grad)
    )  # fmt: skip
    has_h0, trainers = _agree(group, world, device, h0 is not None, training)
    start = torch.zeros(R.shape, dtype=full, device=R.device)
    if has_h0 and rank == 0:
        start = as_kv(h0.to(full)).to(R.device)
    mine = torch.cat([P, R, start], dim=-1).to(device).contiguous()  # [B, HV, K, K + 2 V]
    every = _gather(mine, group, world, trainers)
    V = R.shape[-1]
    S = every[0][..., K + V :]

    # 3. the earlier ranks folded in, this rank's tokens run from the true state
    for r in range(rank):
        S = every[r][..., :K] @ S + every[r][..., K : K + V]
    # The folded state in the full dtype, not the given initial state's: a bf16 one rounded every
    # later rank's start (o 1e-3 off the unsharded call, a review, 2026-12-04).
    start = from_kv(S.to(q.device))
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=start, output_final_state=False, **kw)
    if not want_final:
        return o, None
    for r in range(rank, world):
        S = every[r][..., :K] @ S + every[r][..., K : K + V]
    final_dtype = kw.get("final_state_dtype") or full
    return o, from_kv(S.to(q.device)).to(final_dtype)


def _pieces(cu: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The pieces ``(sequence n, first token, end token)`` (global positions) that the tokens
    ``[lo, hi)`` hold of the packed sequences ``cu``, in order; they tile ``[lo, hi)``."""
    out = []
    for n in range(len(cu) - 1):
        a, b = max(cu[n], lo), min(cu[n + 1], hi)
        if a < b:
            out.append((n, a, b))
    return out


def _packed(chunk_kda, group, rank, world, lengths, q, k, v, g, beta, h0, want_final, kw):
    """Packed sequences across ranks: ``cu_seqlens`` (the same on every rank) describes the
    whole packed batch, and rank r holds its tokens ``[sum(T_0..T_r-1), + T_r)``, any T_r
    (zero too). Only a rank's last piece can continue on the next rank: it sends that
    piece's transition (zeros when its sequence ends here), one all-gather; each rank folds
    the earlier ranks' transitions of its first piece's sequence into that sequence's initial
    state, runs its pieces as one packed call, and the final states are summed across ranks
    from the ranks where each sequence ends."""
    cu = _host_offsets(kw)
    N, HV, V = len(cu) - 1, v.shape[2], v.shape[3]
    K = q.shape[-1]
    starts = [sum(lengths[:r]) for r in range(world + 1)]
    every_pieces = [_pieces(cu, starts[r], starts[r + 1]) for r in range(world)]
    mine = every_pieces[rank]
    lo = starts[rank]
    as_kv, from_kv = kv_layout(bool(kw.get("state_v_first", False)))
    device = _device(group, q)
    full = STATE_DTYPES[q.dtype][0]  # (P, R) as affine_transitions gives them; float64 inputs: float64
    # (fla's ignored keywords dropped too: use_graph's check is of the caller's offsets, not a piece's)
    local_kw = {n: x for n, x in kw.items() if n not in ("cu_seqlens", "cu_seqlens_cpu", *IGNORED_KWARGS)}

    def continues(r):  # rank r's last piece goes on past its slice
        pieces = every_pieces[r]
        return bool(pieces) and pieces[-1][2] < cu[pieces[-1][0] + 1]

    # 1. the transition of this rank's last piece, if its sequence continues on the next rank
    P = torch.zeros(1, HV, K, K, dtype=full, device=q.device)
    R = torch.zeros(1, HV, K, V, dtype=full, device=q.device)
    if continues(rank):
        _, a, b = mine[-1]
        span = slice(a - lo, b - lo)
        piece = [x[:, span] for x in (q, k, v, g, beta)]
        P, R = affine_transitions(chunk_kda, *piece, local_kw, 1)

    # 2. every rank's, in one all-gather (differentiable when training, as the batched path)
    training = torch.is_grad_enabled() and (
        any(x.requires_grad for x in (q, k, v, g, beta)) or (h0 is not None and h0.requires_grad)
        or any(kw.get(n) is not None and kw[n].requires_grad for n in ("A_log", "dt_bias"))
    )  # fmt: skip
    has_h0, trainers = _agree(group, world, device, h0 is not None, training)
    sent = torch.cat([P, R], dim=-1).to(device).contiguous()  # [1, HV, K, K + V]
    every = [e.to(q.device) for e in _gather(sent, group, world, trainers)]

    # 3. each piece's true start: its sequence's initial state, with the earlier ranks'
    # transitions folded in for a first piece that continues a sequence begun on another rank
    def initial(n):
        if h0 is None:
            return torch.zeros(HV, K, V, dtype=full, device=q.device)
        return as_kv(h0[n].to(full))

    begun = [initial(n) for n, _, _ in mine]
    if mine and mine[0][1] > cu[mine[0][0]]:
        n = mine[0][0]
        first_rank = next(r for r in range(rank) if every_pieces[r] and every_pieces[r][-1][0] == n)
        S = initial(n)
        for r in range(first_rank, rank):
            if every_pieces[r]:  # an empty slice in between carries nothing (its transition is zeros)
                S = every[r][0, ..., :K] @ S + every[r][0, ..., K:]
        begun[0] = S
    if trainers:
        # Every rank's outputs depend on the gathered tensor (times zero where unused), so every
        # rank's backward runs the all-gather's backward collective once, as the others' do.
        anchor = sum(e.sum() for e in every) * 0.0
    local_cu_host = torch.tensor([0, *[b - lo for _, _, b in mine]], dtype=torch.int64)
    if mine:
        start = from_kv(torch.stack(begun))  # in the full dtype (see the batched path)
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=start, output_final_state=want_final,
                          cu_seqlens=local_cu_host.to(q.device), cu_seqlens_cpu=local_cu_host, **local_kw)  # fmt: skip
    else:  # an empty slice
        o, ht = torch.empty_like(v, dtype=q.dtype), None
    if trainers:
        o = o + anchor.to(o.dtype)
    if not want_final:
        return o, None

    # 4. final states: each sequence's from the rank where it ends (a sum over ranks of
    # disjoint rows; an empty sequence's is its initial state, on every rank)
    final_dtype = kw.get("final_state_dtype") or full
    owned = [i for i, (n, _, b) in enumerate(mine) if b == cu[n + 1]]
    rows = [mine[i][0] for i in owned]
    finals = torch.zeros(N, HV, K, V, dtype=full, device=device)
    if rows:
        finals[rows] = as_kv(ht[owned].to(full)).detach().to(device)
    dist.all_reduce(finals, group=group)
    finals = finals.to(q.device)
    empty = [n for n in range(N) if cu[n] == cu[n + 1]]
    if empty:
        finals[empty] = torch.stack([initial(n) for n in empty]).detach()
    out = from_kv(finals).to(final_dtype)
    if rows and trainers:  # this rank's own rows keep their gradient (the exchange is not differentiable)
        mask = torch.zeros(N, dtype=torch.bool, device=q.device)
        mask[rows] = True
        mine_rows = torch.zeros_like(out).index_copy(0, torch.tensor(rows, device=q.device), ht[owned].to(final_dtype))
        out = torch.where(mask.view(N, 1, 1, 1), mine_rows, out)
    if empty and trainers and h0 is not None and h0.requires_grad:
        keep = torch.zeros(N, dtype=torch.bool, device=q.device)
        keep[empty] = True
        out = torch.where(keep.view(N, 1, 1, 1), h0.to(final_dtype), out)
    return o, out


def from_fla_cp_context(kw: dict):
    """fla's contiguous ``cp_context`` in ``kw`` (popped) as kda's description: returns its
    process group and puts the whole batch's ``cu_seqlens`` (and its host copy) into ``kw``.
    fla gives each rank its local offsets and whether its first piece begins a sequence
    (``is_first_rank``) and its last piece ends one (``is_last_rank``); the ranks' local
    lengths, all-gathered, rebuild the global offsets."""
    ctx = kw.pop("cp_context")
    if getattr(ctx, "layout", "contiguous") != "contiguous":
        raise ValueError(f"fla's `cp_context` with layout={ctx.layout!r}: kda takes the contiguous layout "
                         "(one interval of the packed tokens per rank)")  # fmt: skip
    if ctx.group is None or ctx.cu_seqlens is None:
        raise ValueError("fla's `cp_context` needs its `group` and `cu_seqlens` (build it with build_cp_context)")
    local = (ctx.cu_seqlens_cpu if ctx.cu_seqlens_cpu is not None else ctx.cu_seqlens).tolist()
    lengths = [b - a for a, b in zip(local, local[1:])]
    gathered = [None] * dist.get_world_size(ctx.group)
    dist.all_gather_object(gathered, (lengths, bool(ctx.is_first_rank), bool(ctx.is_last_rank)), group=ctx.group)
    sequences: list[int] = []
    continuing = False  # the last piece so far goes on into the next rank's
    for pieces, first_begins, last_ends in gathered:
        for i, n in enumerate(pieces):
            if i == 0 and continuing and not first_begins:
                sequences[-1] += n
            else:
                sequences.append(n)
        if pieces:  # a rank of no tokens ends nothing: a sequence goes on past it (2026-12-05)
            continuing = not last_ends
    offsets = [0]
    for n in sequences:
        offsets.append(offsets[-1] + n)
    host = torch.tensor(offsets, dtype=torch.int64)
    kw["cu_seqlens"], kw["cu_seqlens_cpu"] = host.to(ctx.cu_seqlens.device), host
    return ctx.group
