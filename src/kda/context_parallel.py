"""Context parallelism across ranks (spec section 8): ``chunk_kda(..., cp_group=group)`` with
every rank of ``group`` holding its contiguous slice of the tokens of the same B sequences
(rank r: tokens ``[r T_local, (r + 1) T_local)`` of each, T_local the same on every rank).

The state after a run of tokens is affine in the state before it, ``S_after = P S_before + R``
(``reference.segment_transition``). Each rank

1. finds its own ``(P, R)`` with the chunk kernels themselves: R is the final state of its
   tokens run from a zero state, P the final states of its tokens with v = 0 run from the
   columns of the identity (``ceil(K / V)`` runs: each state holds V columns of P);
2. all-gathers every rank's ``(P, R)`` and the first rank's initial state in float32 (one
   collective: ``K x K + 2 K x V`` per sequence and value head);
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

Not supported yet: ``cu_seqlens`` (packed sequences across ranks), fla's ``cp_context``.
Collectives run on the group's own timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kda.transitions import affine_transitions, kv_layout


def _check(group, q: torch.Tensor, kw: dict) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("`cp_group` needs an initialised torch.distributed process group")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"`cp_group` is not a usable process group: {err}") from None
    if rank < 0:
        raise ValueError("`cp_group`: this process is not a member of the group")
    if kw.get("cu_seqlens") is not None:
        raise ValueError("`cp_group` with `cu_seqlens` (packed sequences across ranks) is not supported yet")
    if kw.get("cp_context") is not None:
        raise ValueError("`cp_group` and fla's `cp_context` are exclusive (kda takes `cp_group`)")
    # every rank must hold the same shapes: one small all-gather, so a mismatch fails on every rank
    shape = torch.tensor([*q.shape, *kw["v"].shape[2:]], dtype=torch.int64, device=_device(group, q))
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    if any(not torch.equal(s, shapes[0]) for s in shapes):
        raise ValueError("`cp_group`: the ranks' slices differ in shape (B, T_local, H, K, HV, V): "
                         f"{[s.tolist() for s in shapes]}")  # fmt: skip
    return rank, world


def _device(group, like: torch.Tensor) -> torch.device:
    """Where the group's collectives take tensors: the inputs' device for NCCL, the CPU for gloo."""
    return like.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def chunk_kda_context_parallel(chunk_kda, group, q, k, v, g, beta, kw: dict):
    """``chunk_kda(q, k, v, g, beta, **kw)`` on this rank's slice of the tokens; see the module."""
    rank, world = _check(group, q, dict(kw, v=v))
    B, _, _, K = q.shape
    v_first = bool(kw.get("state_v_first", False))
    h0 = kw.pop("initial_state", None)
    want_final = bool(kw.pop("output_final_state", False))
    device = _device(group, q)
    # 1. this rank's transition, float32, KV layout
    P, R = affine_transitions(chunk_kda, q, k, v, g, beta, kw, B)
    as_kv, from_kv = kv_layout(v_first)

    # 2. every rank's transition and the first rank's initial state, in one all-gather
    # (differentiable when autograd records: the gradients go back to the ranks they came
    # from; one collective, so every rank's backward runs the same collectives in the same order)
    training = torch.is_grad_enabled() and (
        any(x.requires_grad for x in (P, R)) or (h0 is not None and h0.requires_grad)
    )  # fmt: skip
    counts = torch.tensor([h0 is not None, training], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    has_h0, trainers = (int(c) for c in counts.tolist())
    if has_h0 not in (0, world):
        raise ValueError("`cp_group`: pass `initial_state` on every rank or on none")
    if trainers not in (0, world):
        raise ValueError("`cp_group`: inputs require grad on some ranks and not on others; the backward's "
                         "collectives pair up across ranks, so every rank trains or none does")  # fmt: skip
    start = torch.zeros(R.shape, dtype=torch.float32, device=R.device)
    if has_h0 and rank == 0:
        start = as_kv(h0.float()).to(R.device)
    mine = torch.cat([P, R, start], dim=-1).to(device).contiguous()  # [B, HV, K, K + 2 V]
    if trainers:
        import warnings

        from torch.distributed.nn import functional as dist_autograd

        with warnings.catch_warnings():
            # torch 2.13 marks it deprecated in favour of the private functional collectives
            # (torch.distributed._functional_collectives, whose names changed between 2.11 and
            # 2.13); this public one runs on gloo too (off NCCL its backward is an all-to-all).
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather is deprecated")
            every = dist_autograd.all_gather(mine, group=group)
    else:
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
    V = R.shape[-1]
    S = every[0][..., K + V :]

    # 3. the earlier ranks folded in, this rank's tokens run from the true state
    for r in range(rank):
        S = every[r][..., :K] @ S + every[r][..., K : K + V]
    start = from_kv(S.to(q.device))
    if h0 is not None:
        start = start.to(h0.dtype)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=start, output_final_state=False, **kw)
    if not want_final:
        return o, None
    for r in range(rank, world):
        S = every[r][..., :K] @ S + every[r][..., K : K + V]
    final_dtype = kw.get("final_state_dtype") or torch.float32
    return o, from_kv(S.to(q.device)).to(final_dtype)
