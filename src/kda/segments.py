"""The segment split of long sequences within one GPU (spec section 8).

A call with few (sequence, head) chains leaves most SMs idle while each chain walks its
sequence chunk by chunk. Cut every sequence longer than L tokens into segments of L and:

1. every segment's affine transition ``(P, R)`` from the chunk kernels
   (``transitions.affine_transitions``), all segments at once as one packed batch, and the
   outputs of those runs: the output from a zero state and the output's response to the state;
2. the boundary states ``S_{j+1} = P_j S_j + R_j`` of each sequence (a short chain of float64
   products, one kernel on a GPU: :func:`chain_boundaries`);
3. every segment's output from its true entering state, ``o_zero + o_P S`` token by token
   (:func:`entering_outputs`).

The chains multiply by the segments per sequence; the price is about twice the arithmetic
(the transitions' runs), so it pays only where the uncut call leaves most SMs idle.
``KDA_SEGMENT_TOKENS`` sets it: unset, automatic (:func:`auto_span`: calls the CUDA path runs
whose long sequences have too few chains for the SMs); 0, off; a positive multiple of 16,
split sequences longer than that on any backend. Inference calls only (a call that
requires grad is never split), and only calls whose lengths are on the host (a varlen call
left unchecked, ``validation.CHECK_CU_SEQLENS``, is not split). The dispatch log says when a
call is split and why (``chunk_kda: split ... into segments``) and ``record_dispatch``
records ``segments:<L>``.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from kda.transitions import affine_transitions, kv_layout
from kda.validation import STATE_DTYPES

SETTING = "KDA_SEGMENT_TOKENS"

# The automatic split, from the CUDA path on the H200 (`kda bench --long`, benchmarks/NOTES.md,
# runs 18 and 50; the uncut recurrence runs four CTAs a (sequence, head) pair when pairs are few,
# kda.cuda.forward.recurrence_width): on 1x2097152 H8 (32 CTAs on 132 SMs) segments of 16384
# tokens took 63.1 ms against 94.6 uncut (4096: 67.1, 65536: 71.9; fla 90.0); on 1x524288 H16
# (64 CTAs) the split lost at every length (33.0 against 26.1 uncut), and at H32 by 2x or more.
# A sequence counts as long from AUTO_MIN_SEGMENTS segments of this length.
AUTO_SEGMENT_TOKENS = 16384
# The length itself follows the long sequences' segments: the shortest of AUTO_SPANS whose
# long-sequence segment chains are at most AUTO_CHAINS_PER_SM a SM, else the longest. Run 51
# (f1b78dd, a float32 chain of the boundary states) had 4096 tokens fastest on 131072 and
# 524288 at H8, so AUTO_SPANS started at 4096; with the float64 chain of 2a6b010 (one product a
# segment, 40-75 us each) short segments pay for their count, and run 59 (2026-12-03,
# benchmarks/results/h200-2026-12-03-long-run59.md, ms at 4096 / 8192 / 16384 / 65536, uncut,
# fla) had 131072 H8 6.314 / 5.283 / 5.641 / 11.469, 5.947, 5.742; 524288 H8 26.805 / 21.074 /
# 18.648 / 19.423, 23.727, 22.699; 2097152 H8 87.935 / 78.186 / 68.130 / 73.624, 94.852,
# 90.539. So the lengths started at 16384. With the chain in blocks and no third chunk pass
# (run 66, 2026-12-03, benchmarks/results/h200-2026-12-03-long-run66.md, ms at 4096 / 8192 /
# 16384 / 65536, uncut, fla): 131072 H8 5.241 / 4.796 / 5.126 / 8.524, 5.948, 5.746; 524288 H8
# 14.580 / 13.642 / 14.356 / 15.773, 23.505, 22.632; 2097152 H8 55.842 / 52.242 / 51.749 /
# 55.697, 93.967, 90.211: 8192 first (the rule then takes 16384 at 2M tokens, the fastest there).
# With the two runs on one K1 (eab7459) and no v read in the P run (run 69, 2026-12-03,
# benchmarks/results/h200-2026-12-03-long-run69.md, ms at 4096 / 8192 / 16384 / 65536, uncut, fla):
# 131072 H8 4.689 / 4.919 / 5.087 / 8.368, 5.896, 5.683; 524288 H8 12.486 / 12.784 / 13.384 /
# 14.205, 23.490, 22.458; 2097152 H8 47.266 / 42.588 / 41.949 / 47.180, 94.484, 89.852; and
# 1x524288 H16 now splits to advantage, 28.415 / 26.807 / 23.167 / 27.674 against 26.190
# uncut (34.359 fla): at 16384 (512 chains), not at 8192 (1024). So H16 splits, and the
# chains stop at four an SM. Run 70 (acdbcab, the P run reading no v; ms at 8192 / 16384 / 32768
# / 65536, auto, uncut, fla): 131072 H8 4.556 / 4.982 / 5.597 / 8.110, 3.876 (8192), 5.903, 5.721;
# 524288 H8 10.950 / 11.083 / 10.686 / 12.987, 11.032 (8192), 23.703, 22.704; 2097152 H8 39.169 /
# 37.861 / 37.721 / 40.077, 37.220 (32768), 94.227, 90.222; 524288 H16 21.229 / 20.952 / 21.863 /
# 20.328, 19.568 (16384), 26.082, 34.473: the rule's lengths within 7% of each case's fastest.
AUTO_SPANS = (8192, 16384, 32768, 65536)
AUTO_CHAINS_PER_SM = 4
# Split when the long sequences' (sequence, value head) pairs are at most one per this many
# SMs (16 on 132 SMs: H8 and H16 split, H32 not) ...
AUTO_SMS_PER_PAIR = 8
# ... counting as long the sequences of at least this many segments (and only those matter:
# shorter ones are done before the long chains are).
AUTO_MIN_SEGMENTS = 8
# The boundary chain steps one segment at a time up to this many segments a sequence, and in
# blocks beyond (chain_boundaries).
CHAIN_STEPS_UP_TO = 8


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a table the split computes on the host) on ``device`` without a device sync:
    on a GPU through pinned memory, a copy in stream order (torch keeps the pinned block until the
    copy is done). A pageable ``.to(device)`` waits for the stream to drain, and one after the
    transition runs were queued left the GPU idle while the host queued the boundary chain's
    small products one by one: the 2M H8 call's wall time was about 5 ms above its kernels' sum
    on the H200 with pageable copies, 1.1 ms with these (2026-12-05, run 150,
    benchmarks/long_profile.py; 0.306 of fla's time, benchmarks/NOTES.md)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def segment_tokens() -> int | None:
    """The segment length ``KDA_SEGMENT_TOKENS`` asks for: None when unset (the automatic
    choice), 0 for no split."""
    text = os.environ.get(SETTING)  # read every call (tests set it), parsed only when set
    if text is None or not text.strip():
        return None
    try:
        tokens = int(text)
    except ValueError:
        raise ValueError(f"{SETTING} must be a whole number of tokens (a multiple of 16), got {text!r}") from None
    if tokens < 0 or tokens % 16:
        raise ValueError(f"{SETTING} must be 0 (off) or a positive multiple of 16, got {tokens}")
    return tokens


def long_tokens() -> int:
    """The shortest sequence the automatic split counts as long (AUTO_MIN_SEGMENTS segments)."""
    return AUTO_MIN_SEGMENTS * AUTO_SEGMENT_TOKENS


def long_chains(lengths: list[int], value_heads: int) -> int:
    """(sequence, value head) pairs of the sequences the automatic split counts as long."""
    return value_heads * sum(1 for n in lengths if n >= long_tokens())


def auto_span(lengths: list[int], value_heads: int, sms: int) -> int:
    """The automatic segment length for sequences of ``lengths`` tokens with ``value_heads``
    heads on ``sms`` SMs where the long sequences' chains are few enough that the split's
    parallelism pays for its twofold arithmetic (the shortest of AUTO_SPANS that gives
    them at most AUTO_CHAINS_PER_SM segment chains an SM), else 0 (no split)."""
    longs = [n for n in lengths if n >= long_tokens()]
    chains = value_heads * len(longs)  # (long_chains)
    if not chains or chains * AUTO_SMS_PER_PAIR > sms:
        return 0
    for span in AUTO_SPANS:
        if value_heads * sum(-(-n // span) for n in longs) <= AUTO_CHAINS_PER_SM * sms:
            return span
    return AUTO_SPANS[-1]


def chunk_kda_segmented(
    chunk_kda, q, k, v, g, beta, kw: dict, lengths: list[int], span: int, why: str = SETTING, runs=None
):
    """``chunk_kda(q, k, v, g, beta, **kw)`` with every sequence cut into segments of ``span``
    tokens; the same results (o, final state) as the uncut call. ``why``: the log's reason;
    ``runs``: the transitions' runs all at once (``transitions.affine_transitions``)."""
    from kda.dispatch import log_once, note

    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    v_first = bool(kw.get("state_v_first", False))
    as_kv, from_kv = kv_layout(v_first)
    h0 = kw.pop("initial_state", None)
    want_final = bool(kw.pop("output_final_state", False))
    full = STATE_DTYPES[q.dtype][0]  # the full-precision state dtype: float32, or float64 for float64 inputs
    final_dtype = kw.get("final_state_dtype") or full

    pieces = [[min(span, n - a) for a in range(0, n, span)] for n in lengths]  # segment lengths per sequence
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    offsets = torch.tensor([0, *torch.tensor([p for ps in pieces for p in ps], dtype=torch.int64).cumsum(0).tolist()])
    segs = offsets.shape[0] - 1
    log_once(f"chunk_kda: split {len(lengths)} sequences into {segs} segments of <= {span} tokens ({why})")
    note(f"segments:{span}")
    kw = dict(kw, cu_seqlens=to_device(offsets, q.device), cu_seqlens_cpu=offsets)

    P, R, o_zero, o_P = affine_transitions(chunk_kda, *flat, kw, segs, outputs=True, runs=runs)
    S0 = torch.zeros(len(lengths), HV, K, V, dtype=torch.float64, device=q.device)
    if h0 is not None:  # (read as is: a bf16 h0 is not rounded further)
        S0 = as_kv(h0).double()
    starts, finals = chain_boundaries(P, R, S0, [len(ps) for ps in pieces])
    o = entering_outputs(o_zero, o_P, starts, offsets).reshape(B, T, HV, V)
    return o, (from_kv(finals).to(final_dtype) if want_final else None)


def entering_outputs(o_zero, o_P, starts, offsets) -> torch.Tensor:
    """Every segment's output from its entering state, ``o_zero + o_P S`` token by token (S =
    ``starts[j]`` for the tokens of segment j at ``offsets``, on the host; o_zero and o_P from
    ``affine_transitions(outputs=True)``), rounded once to o_zero's dtype. This stands for a
    third pass of the chunk kernels over all tokens from the entering states (the split's form
    until 2026-12-03): the two runs of the transitions already hold what it computes. The price
    is o_zero and o_P each rounded to o's dtype before the sum: on bf16 inputs (the torch
    backend, K = V = 128, benchmarks/split_two_pass_accuracy.py) o moved from 1.66e-3 to 1.68e-3
    against float64 at 16384-token segments, 1.78e-3 at 1024, 2.14e-3 at 512.

    bf16 outputs on a GPU with K and V up to 128: one Triton kernel (kda.triton.segments, whose
    tiles of larger heads would not fit in shared memory); otherwise a float64 product a segment."""
    if o_zero.is_cuda and o_zero.dtype == torch.bfloat16:
        from kda.dispatch import on_device_of
        from kda.triton.segments import MAX_SIDE, add_entering_states

        if max(o_zero.shape[-1], o_P.shape[-1]) <= MAX_SIDE:
            # Triton launches on the current device and its stream: the tensors' own (a review,
            # 2026-12-04: every other Triton launch of kda had the guard).
            with on_device_of(o_zero):
                return add_entering_states(o_zero, o_P, starts, offsets)
    out = torch.empty_like(o_zero)
    bounds = offsets.tolist()
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        moved = torch.einsum("thk,hkv->thv", o_P[0, a:b].double(), starts[j])
        out[0, a:b] = (o_zero[0, a:b].double() + moved).to(out.dtype)
    return out


def chain_boundaries(P, R, S0, counts: list[int], block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering every segment and each sequence's final state: ``S_{j+1} = P_j S_j +
    R_j`` from ``S0[n]`` over sequence n's ``counts[n]`` segments (P ``[segs, HV, K, K]``, R
    ``[segs, HV, K, V]``, sequence by sequence), in float64: float64 keeps them exact to the
    transitions' own rounding whatever torch's float32 matmul precision is set to (TF32 would put
    1e-3 into every boundary state).

    In blocks of ``block`` segments (default, where the kernel below does not take it: on a GPU,
    about the square root of the longest count past CHAIN_STEPS_UP_TO segments; 1, and on the CPU,
    where the steps are the arithmetic:
    one step a segment, :func:`chain_steps`): the maps composed within every block, all blocks
    together (``block - 1`` steps); the boundary states of the blocks (:func:`chain_steps` over
    the blocks' composed maps); then every segment's entering state from its block's, one
    batched product. About ``2 sqrt(n)`` steps for n segments in place of n: a step is a few
    torch calls, about 40 us of host time each on the H200's host, beside which the float64
    products are small (one a segment took 4.93 ms for 128 segments x 8 heads, the same in
    float32; benchmarks/NOTES.md, run 60).

    On a GPU (``block`` None, K up to 128) all of it is one Triton kernel, one step a segment
    (kda.triton.segments.chain_states): the torch forms' small products queued about 90 kernels
    a call, and the GPU waited between them."""
    if block is None and S0.is_cuda:
        from kda.dispatch import on_device_of
        from kda.triton.segments import MAX_SIDE, chain_states

        if R.shape[-2] <= MAX_SIDE:
            with on_device_of(S0):
                return chain_states(P, R, S0, counts)
    b = block or (torch_block(counts) if S0.is_cuda else 1)
    if b <= 1:
        return chain_steps(P, R, S0, counts)
    # Sequences of b segments or fewer step one segment at a time: padded to a block of b, many
    # short sequences beside a long one would multiply the maps held (and composed) by b.
    longs = [n for n, c in enumerate(counts) if c > b]
    if len(longs) == len(counts):
        return chain_blocks(P, R, S0, counts, b)
    shorts = [n for n, c in enumerate(counts) if c <= b]
    first = list(itertools.accumulate(counts, initial=0))
    starts = torch.empty(P.shape[0], *R.shape[1:], dtype=torch.float64, device=S0.device)
    finals = torch.empty(S0.shape, dtype=torch.float64, device=S0.device)
    for part, chain in ((longs, lambda *a: chain_blocks(*a, b)), (shorts, chain_steps)):
        if part:
            at = torch.tensor([j for n in part for j in range(first[n], first[n + 1])], dtype=torch.int64)
            at, seqs = to_device(at, S0.device), to_device(torch.tensor(part, dtype=torch.int64), S0.device)
            starts[at], finals[seqs] = chain(P[at], R[at], S0[seqs], [counts[n] for n in part])
    return starts, finals


def torch_block(counts: list[int]) -> int:
    """The torch chain's block on a GPU: ceil(sqrt(the longest count)) past CHAIN_STEPS_UP_TO
    segments, else 1 (one step a segment)."""
    most = max(counts, default=0)
    return math.isqrt(most - 1) + 1 if most > CHAIN_STEPS_UP_TO else 1


def chain_blocks(P, R, S0, counts: list[int], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chain_boundaries` in blocks of ``b`` segments (float64)."""
    HV, K, V = R.shape[1:]
    device = S0.device
    # Each sequence padded to whole blocks by identity maps (P = I, R = 0); block position i of
    # block m at [i, m], so that one position of every block is one contiguous batch.
    blocks = [-(-c // b) for c in counts]
    nblocks = sum(blocks)
    # padded slot (i, m) of each real segment, sequence by sequence
    slot = []
    m0 = 0
    for c, nb in zip(counts, blocks):
        slot += [(j % b) * nblocks + m0 + j // b for j in range(c)]
        m0 += nb
    slot_t = to_device(torch.tensor(slot, dtype=torch.int64), device)
    maps = torch.zeros(b * nblocks, HV, K, K + V, dtype=torch.float64, device=device)
    maps[..., :K] = torch.eye(K, dtype=torch.float64, device=device)
    maps[slot_t, ..., :K] = P.double()
    maps[slot_t, ..., K:] = R.double()
    maps = maps.view(b, nblocks, HV, K, K + V)
    for i in range(1, b):  # maps[i] = maps[i] o maps[i - 1]: (P_i P', P_i R' + R_i)
        composed = torch.matmul(maps[i, ..., :K], maps[i - 1])
        composed[..., K:] += maps[i, ..., K:]
        maps[i] = composed
    block_starts, finals = chain_steps(maps[b - 1, ..., :K], maps[b - 1, ..., K:], S0, blocks)
    starts = torch.empty(b, nblocks, HV, K, V, dtype=torch.float64, device=device)
    starts[0] = block_starts  # position i >= 1 enters with the block's first i segments applied:
    starts[1:] = torch.matmul(maps[: b - 1, ..., :K], block_starts) + maps[: b - 1, ..., K:]
    return starts.view(b * nblocks, HV, K, V)[slot_t], finals


def chain_steps(P, R, S0, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chain_boundaries` one step a segment (float64).

    All sequences step together, one batched product a step: the sequences sorted by segment
    count, longest first, so that those still going at step j are a prefix (a batch of many
    short sequences and one long one takes as many steps as the long one has segments)."""
    N = len(counts)
    first = list(itertools.accumulate(counts, initial=0))
    order = sorted(range(N), key=lambda n: -counts[n])
    steps = counts[order[0]] if N else 0
    active, going = [], N  # active[j]: the sequences with more than j segments (a prefix of order)
    for j in range(steps):
        while counts[order[going - 1]] <= j:
            going -= 1
        active.append(going)
    gather = [first[n] + j for j in range(steps) for n in order[: active[j]]]  # segment ids, step by step
    index = to_device(torch.tensor(order + gather, dtype=torch.int64), S0.device)  # one host-to-device copy
    order_t, gather_t = index[:N], index[N:]
    P, R = P[gather_t].double(), R[gather_t].double()
    S = S0.double()[order_t]
    starts = torch.empty_like(R)
    at = 0
    for a in active:
        starts[at : at + a] = S[:a]
        stepped = torch.baddbmm(R[at : at + a].flatten(0, 1), P[at : at + a].flatten(0, 1), S[:a].flatten(0, 1))
        S[:a] = stepped.view_as(S[:a])
        at += a
    in_order = torch.empty_like(starts)
    in_order[gather_t] = starts
    finals = torch.empty_like(S)
    finals[order_t] = S
    return in_order, finals
