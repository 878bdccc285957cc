"""The segment split's outputs from the segments' entering states (kda.segments, spec section 8):
``o = o_zero + o_P S`` token by token, S the entering state of the token's segment, o_zero the
output from zero states and o_P its response to the state (transitions.affine_transitions), in
one kernel on a GPU, rounded once to o's dtype.

S (float64) goes in as two bf16 parts, ``S = S_hi + S_lo`` to 16 bits, each a bf16 product with
float32 accumulation on the tensor cores: o_P is bf16 itself, so both products are exact to the
accumulation, and each term is S's to a relative 2^-17, far below o's own rounding (2^-9) but
for the rare sum that cancels to a small fraction of its terms."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kda.segments import to_device
from kda.triton.common import interpreting

ROWS = 128  # tokens of one segment a tile
# Tiles a program: the segment's state (two bf16 parts, 64 KB at K = V = 128) is loaded once for
# them. 1 until measured otherwise: on the 2M H8 split the kernel moved 12.9 GB in 6.08 ms on the
# H200 (2.1 TB/s of 4.28; 2026-12-05, run 150), each program reading the state from L2 for 128
# tokens. KDA_SPLIT_OUTPUT_TILES (read at import) sets it for an A/B (benchmarks/NOTES.md).
TILES = int(os.environ.get("KDA_SPLIT_OUTPUT_TILES", "1"))
# The programs' order: a token block's heads one after another (1), so that programs running
# together read whole tokens (HV x K contiguous), or a head's blocks one after another (the
# order until measured otherwise: programs running together read a head's 256-byte rows, 2 KB
# apart at H8). KDA_SPLIT_OUTPUT_HEADS_FIRST (read at import) sets it for an A/B.
HEADS_FIRST = os.environ.get("KDA_SPLIT_OUTPUT_HEADS_FIRST") == "1"
MAX_SIDE = 128  # K and V: at 256 a program's tiles ask for 192-320 KB of shared memory (sm_90 holds 227)


@triton.jit
def add_entering_states_kernel(
    o_zero, o_P, s_hi, s_lo, out, table,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr, BT: tl.constexpr,
    blocks, TILES: tl.constexpr, HEADS_FIRST: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    if HEADS_FIRST:
        i = pid // HV
        h = pid % HV
    else:
        i = pid % blocks
        h = pid // blocks
    seg = tl.load(table + 3 * i)  # (segment, first token, end token), int64
    t0 = tl.load(table + 3 * i + 1)
    t1 = tl.load(table + 3 * i + 2)
    ks = tl.arange(0, KP)
    vs = tl.arange(0, VP)
    s_at = ((seg * HV + h) * K + ks[:, None]) * V + vs[None, :]
    s_ok = (ks[:, None] < K) & (vs[None, :] < V)
    hi = tl.load(s_hi + s_at, mask=s_ok, other=0.0)
    lo = tl.load(s_lo + s_at, mask=s_ok, other=0.0)
    if INTERPRET:  # (the interpreter's bf16 dot is wrong, seen with Triton 3.9.0 and NumPy 2.4: float32 there)
        hi, lo = hi.to(tl.float32), lo.to(tl.float32)
    for tile in tl.static_range(TILES):  # BT tokens a tile, the state loaded once for all
        rows = t0 + tile * BT + tl.arange(0, BT).to(tl.int64)
        row_ok = rows < t1
        a_ok = row_ok[:, None] & (ks[None, :] < K)
        a = tl.load(o_P + (rows[:, None] * HV + h) * K + ks[None, :], mask=a_ok, other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            acc = tl.dot(a, hi, input_precision="ieee") + tl.dot(a, lo, input_precision="ieee")
        else:
            acc = tl.dot(a, hi) + tl.dot(a, lo)
        o_at = (rows[:, None] * HV + h) * V + vs[None, :]
        o_ok = row_ok[:, None] & (vs[None, :] < V)
        acc += tl.load(o_zero + o_at, mask=o_ok, other=0.0).to(tl.float32)
        tl.store(out + o_at, acc.to(out.dtype.element_ty), mask=o_ok)


def block_table(offsets: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """``[blocks, 3]`` int64 on the host: (segment, first token, end token) of every run of at
    most ``rows`` tokens of one segment, for segments at ``offsets`` ([segs + 1], on the host)."""
    lengths = offsets[1:] - offsets[:-1]
    blocks = (lengths + rows - 1) // rows
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    start = offsets[:-1][seg] + (torch.arange(seg.numel()) - first_block[seg]) * rows
    return torch.stack([seg, start, torch.minimum(start + rows, offsets[1:][seg])], 1)


def add_entering_states(
    o_zero, o_P, starts, offsets, out: torch.Tensor | None = None, tiles: int | None = None,
    heads_first: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """``o_zero + o_P S`` ([1, T, HV, V] in o_zero's dtype, bf16; into ``out`` where given) with
    S = ``starts[j]`` ([segs, HV, K, V], float64, K-first) for the tokens of segment j
    (``offsets`` [segs + 1], on the host, covering the T tokens); K and V up to MAX_SIDE (a
    program's tiles, 96 KB of shared memory at 128, compiled for sm_90). ``tiles``: of ROWS
    tokens a program (default TILES); ``heads_first``: the programs' order (default HEADS_FIRST).
    Each tile's arithmetic is the same whatever the count and order."""
    tiles = TILES if tiles is None else tiles
    heads_first = HEADS_FIRST if heads_first is None else heads_first
    if tiles < 1:
        raise ValueError(f"tiles must be at least 1, got {tiles}")
    _, T, HV, V = o_zero.shape
    K = o_P.shape[-1]
    if o_zero.dtype != torch.bfloat16 or o_P.dtype != torch.bfloat16:
        raise TypeError(f"o_zero and o_P must be bfloat16 (the products' operands), got {o_zero.dtype}, {o_P.dtype}")
    if max(K, V) > MAX_SIDE:
        raise ValueError(f"K and V must be at most {MAX_SIDE} (the tiles in shared memory), got K={K}, V={V}")
    out = torch.empty(o_zero.shape, dtype=o_zero.dtype, device=o_zero.device) if out is None else out
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    table = to_device(block_table(offsets, ROWS * tiles), o_zero.device)
    if table.shape[0] == 0:
        return out
    # (contiguous: the kernel indexes them so; the chain's states keep the caller's layout's
    # strides, which read as if contiguous put the wrong values in o, the H200 in run 66)
    s_hi = starts.to(torch.bfloat16).contiguous()
    s_lo = (starts - s_hi.double()).to(torch.bfloat16).contiguous()
    # (tl.dot wants sides of 16 or more)
    KP, VP = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    blocks = table.shape[0]
    add_entering_states_kernel[(blocks * HV,)](
        o_zero.contiguous(), o_P.contiguous(), s_hi, s_lo, out, table, HV=HV, K=K, V=V, KP=KP, VP=VP, BT=ROWS,
        blocks=blocks, TILES=tiles, HEADS_FIRST=heads_first, INTERPRET=interpreting(), num_warps=8,
    )  # fmt: skip
    return out
