"""The segment split's outputs from the segments' entering states (kda.segments, spec section 8):
``o = o_zero + o_P S`` token by token, S the entering state of the token's segment, o_zero the
output from zero states and o_P its response to the state (transitions.affine_transitions), in
one kernel on a GPU, rounded once to o's dtype.

S (float64) goes in as two bf16 parts, ``S = S_hi + S_lo`` to 16 bits, each a bf16 product with
float32 accumulation on the tensor cores: o_P is bf16 itself, so both products are exact to the
accumulation, and each term is S's to a relative 2^-17, far below o's own rounding (2^-9) but
for the rare sum that cancels to a small fraction of its terms."""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from kda.segments import to_device
from kda.triton.common import interpreting

ROWS = 128  # tokens of one segment a tile
MAX_SIDE = 128  # K and V: at 256 a program's tiles ask for 192-320 KB of shared memory (sm_90 holds 227)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How add_entering_states_kernel's programs cover the outputs; every choice gives the same
    bits (each tile's arithmetic is the same).

    The defaults are the fastest of benchmarks/output_launch_sweep.py's 17 launches on the 2M H8
    call's shapes (2026-12-05, run 151, an H100; benchmarks/NOTES.md): 4.84 ms against 6.99 for one
    unrolled tile a program in a head's order (the launch until then), 2.66 TB/s of the copy's
    3.00; the whole call 30.9 and 31.3 ms against 33.2 and 33.5."""

    tiles: int = 8  # ROWS-token tiles a program, the segment's state loaded once for them
    stages: int = 2  # 0: the tiles' loop unrolled; n: Triton's software pipeline of n stages over it
    heads_first: bool = True  # a token block's heads one after another, else a head's blocks
    v_parts: int = 1  # programs a (block, head) pair, each a V slice (its state columns only)
    warps: int = 8

    def __post_init__(self):
        for name in ("tiles", "v_parts", "warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Launch.{name} must be at least 1, got {getattr(self, name)}")
        if self.stages < 0:
            raise ValueError(f"Launch.stages must be 0 or more, got {self.stages}")


SETTING = "KDA_SPLIT_OUTPUT_LAUNCH"


def launch_from(text: str) -> Launch:
    """A Launch from ``"tiles=8,stages=2,heads_first=1"`` (SETTING's form; fields not named keep
    their defaults; "" is the default launch)."""
    fields = {f.name for f in dataclasses.fields(Launch)}
    given = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().isdigit():
            raise ValueError(f"{SETTING} must be comma-separated name=count of {sorted(fields)}, got {text!r}")
        given[name] = bool(int(value)) if name == "heads_first" else int(value)
    return Launch(**given)


# (SETTING, read at import, names another launch, for tuning on another GPU)
LAUNCH = launch_from(os.environ.get(SETTING, ""))


@triton.jit
def add_entering_states_kernel(
    o_zero, o_P, s_hi, s_lo, out, table, blocks,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, V_PARTS: tl.constexpr,
    BT: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, HEADS_FIRST: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    part = pid % V_PARTS
    pair = pid // V_PARTS
    if HEADS_FIRST:
        i = pair // HV
        h = pair % HV
    else:
        i = pair % blocks
        h = pair // blocks
    seg = tl.load(table + 3 * i)  # (segment, first token, end token), int64
    t0 = tl.load(table + 3 * i + 1)
    t1 = tl.load(table + 3 * i + 2)
    ks = tl.arange(0, KP)
    vs = part * BV + tl.arange(0, BV)
    s_at = ((seg * HV + h) * K + ks[:, None]) * V + vs[None, :]
    s_ok = (ks[:, None] < K) & (vs[None, :] < V)
    hi = tl.load(s_hi + s_at, mask=s_ok, other=0.0)
    lo = tl.load(s_lo + s_at, mask=s_ok, other=0.0)
    if INTERPRET:  # (the interpreter's bf16 dot is wrong, seen with Triton 3.9.0 and NumPy 2.4: float32 there)
        hi, lo = hi.to(tl.float32), lo.to(tl.float32)
    if STAGES == 0:
        for tile in tl.static_range(TILES):
            add_tile(o_zero, o_P, out, hi, lo, t0 + tile * BT, t1, h, ks, vs, HV, K, V, BT, INTERPRET)
    else:
        for tile in tl.range(0, TILES, num_stages=STAGES):
            add_tile(o_zero, o_P, out, hi, lo, t0 + tile * BT, t1, h, ks, vs, HV, K, V, BT, INTERPRET)


@triton.jit
def add_tile(o_zero, o_P, out, hi, lo, first, t1, h, ks, vs, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """One tile: BT tokens from ``first`` (those before ``t1``), the columns ``vs``."""
    rows = first + tl.arange(0, BT).to(tl.int64)
    row_ok = rows < t1
    a = tl.load(o_P + (rows[:, None] * HV + h) * K + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
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


def add_entering_states(o_zero, o_P, starts, offsets, out: torch.Tensor | None = None, launch: Launch | None = None):
    """``o_zero + o_P S`` ([1, T, HV, V] in o_zero's dtype, bf16; into ``out`` where given) with
    S = ``starts[j]`` ([segs, HV, K, V], float64, K-first) for the tokens of segment j
    (``offsets`` [segs + 1], on the host, covering the T tokens); K and V up to MAX_SIDE (a
    program's tiles, 96 KB of shared memory at 128, compiled for sm_90). ``launch``: how the
    programs cover the outputs (the same bits whatever it is; LAUNCH, read at the call, where None)."""
    launch = LAUNCH if launch is None else launch
    _, T, HV, V = o_zero.shape
    K = o_P.shape[-1]
    if o_zero.dtype != torch.bfloat16 or o_P.dtype != torch.bfloat16:
        raise TypeError(f"o_zero and o_P must be bfloat16 (the products' operands), got {o_zero.dtype}, {o_P.dtype}")
    if max(K, V) > MAX_SIDE:
        raise ValueError(f"K and V must be at most {MAX_SIDE} (the tiles in shared memory), got K={K}, V={V}")
    # (tl.dot wants sides of 16 or more)
    KP, VP = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    if VP % launch.v_parts or VP // launch.v_parts < 16:
        raise ValueError(f"launch.v_parts must split {VP} columns into slices of 16 or more, got {launch.v_parts}")
    out = torch.empty(o_zero.shape, dtype=o_zero.dtype, device=o_zero.device) if out is None else out
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    table = to_device(block_table(offsets, ROWS * launch.tiles), o_zero.device)
    if table.shape[0] == 0:
        return out
    # (contiguous: the kernel indexes them so; the chain's states keep the caller's layout's
    # strides, which read as if contiguous put the wrong values in o, the H200 in run 66)
    s_hi = starts.to(torch.bfloat16).contiguous()
    s_lo = (starts - s_hi.double()).to(torch.bfloat16).contiguous()
    blocks = table.shape[0]
    add_entering_states_kernel[(blocks * HV * launch.v_parts,)](
        o_zero.contiguous(), o_P.contiguous(), s_hi, s_lo, out, table, blocks, HV=HV, K=K, V=V, KP=KP,
        BV=VP // launch.v_parts, V_PARTS=launch.v_parts, BT=ROWS, TILES=launch.tiles, STAGES=launch.stages,
        HEADS_FIRST=launch.heads_first, INTERPRET=interpreting(), num_warps=launch.warps,
    )  # fmt: skip
    return out


# The boundary chain in one kernel (chain_states): a program a (sequence, head, CHAIN_BV state
# columns), P's columns CHAIN_BK at a time, CHAIN_WARPS warps. Compiled for sm_90 (Triton 3.9 on
# the CPU machine, 2026-12-05, tests/compile_hopper.py --ptxas): float64 products on the tensor
# cores (mma.m8n8k4.f64), 128 registers and no spills with the strides of the 2M H8 bench call
# (multiples of 16, the unit ones constant); a review's builds with other strides took 190-255
# and at worst 16 B of spills: one CTA an SM either way, where the grid is a few dozen CTAs.
CHAIN_BK, CHAIN_BV, CHAIN_WARPS = 32, 16, 8


@triton.jit
def chain_states_kernel(
    P, R, S0, starts, finals, first, counts,
    p_s, p_h, p_i, p_j, r_s, r_h, r_k, r_v, s0_n, s0_h, s0_k, s0_v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """``S_{j+1} = P_j S_j + R_j`` over one sequence's segments for one head and BV state columns,
    in float64: S_j into ``starts`` (the state entering segment j), the last into ``finals``.
    The product reads S_j back from ``starts`` CHAIN_BK rows at a time, after a CTA barrier (a
    CTA's own global stores are visible to it past the barrier): Triton cannot slice a register
    tensor, and P whole ([128, 128] float64 in registers) spilled. (No barrier after the reads:
    the next step writes the next segment's block.) num_stages=1 at the launch: no software
    pipeline may hoist a step's reads of ``starts`` above its barrier."""
    tiles = tl.cdiv(V, BV)
    pid = tl.program_id(0).to(tl.int64)  # (n HV K V passes 2^31 with thousands of sequences)
    vt = pid % tiles
    n = pid // tiles // HV
    h = pid // tiles % HV
    seg0 = tl.load(first + n)
    count = tl.load(counts + n)
    ks = tl.arange(0, KP)
    vs = vt * BV + tl.arange(0, BV)
    k_ok = ks < K
    ok = k_ok[:, None] & (vs[None, :] < V)
    S = tl.load(S0 + n * s0_n + h * s0_h + ks[:, None] * s0_k + vs[None, :] * s0_v, mask=ok, other=0.0)
    S = S.to(tl.float64)
    at = (h * K + ks[:, None]) * V + vs[None, :]  # (segment j's block of starts: j HV K V further)
    for j in range(count):
        seg = (seg0 + j).to(tl.int64)
        block = starts + seg * (HV * K * V)
        tl.store(block + at, S, mask=ok)
        tl.debug_barrier()  # S_j stored by every thread before any reads it back
        S = tl.load(R + seg * r_s + h * r_h + ks[:, None] * r_k + vs[None, :] * r_v, mask=ok, other=0.0)
        S = S.to(tl.float64)
        for c0 in tl.static_range(0, KP, BK):
            cs = c0 + tl.arange(0, BK)
            c_ok = cs < K
            p = tl.load(P + seg * p_s + h * p_h + ks[:, None] * p_i + cs[None, :] * p_j,
                        mask=k_ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
            s_ok = c_ok[:, None] & (vs[None, :] < V)
            s = tl.load(block + (h * K + cs[:, None]) * V + vs[None, :], mask=s_ok, other=0.0)
            S = tl.dot(p.to(tl.float64), s, S, out_dtype=tl.float64)  # (Triton 3.6 asks for out_dtype)
    tl.store(finals + ((n * HV + h) * K + ks[:, None]) * V + vs[None, :], S, mask=ok)


def chain_states(P, R, S0, counts: list[int], out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kda.segments.chain_boundaries in one kernel: ``(starts [segs, HV, K, V], finals [N, HV, K,
    V])``, float64 and contiguous, from P ``[segs, HV, K, K]`` and R ``[segs, HV, K, V]`` (any
    strides, float32 or float64; the segments sequence by sequence, ``counts[n]`` of sequence n)
    and S0 ``[N, HV, K, V]``; K up to MAX_SIDE (the registers of a program's P columns). One step a
    segment, as chain_steps, where the torch chain queued about 90 small kernels a call (the 2M H8
    call: about 1.1 ms of kernels and as much again of the GPU waiting between them, the H200,
    2026-12-05, run 150, benchmarks/NOTES.md). ``out``: (starts, finals) to write into, contiguous
    float64 of those shapes."""
    from kda.dispatch import log_once, note

    segs, HV, K, V = R.shape
    if K > MAX_SIDE:
        raise ValueError(f"K must be at most {MAX_SIDE} (a program's P columns in registers), got K={K}")
    if P.shape != (segs, HV, K, K) or S0.shape != (len(counts), HV, K, V) or sum(counts) != segs:
        raise ValueError(f"P {tuple(P.shape)}, R {tuple(R.shape)}, S0 {tuple(S0.shape)} and counts {counts} disagree")
    if out is None:
        out = (torch.empty(segs, HV, K, V, dtype=torch.float64, device=R.device),
               torch.empty(S0.shape, dtype=torch.float64, device=R.device))  # fmt: skip
    starts, finals = out
    for name, x, shape in (("starts", starts, (segs, HV, K, V)), ("finals", finals, tuple(S0.shape))):
        if x.shape != shape or x.dtype != torch.float64 or not x.is_contiguous():
            raise ValueError(f"out's {name} must be contiguous float64 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if not counts:
        return starts, finals
    first = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)[:-1]
    table = to_device(torch.stack([first, torch.tensor(counts, dtype=torch.int64)]), R.device)
    note("triton:chain_states")
    log_once("chunk_kda: the split's boundary chain in one Triton kernel (chain_states)")
    chain_states_kernel[(len(counts) * HV * triton.cdiv(V, CHAIN_BV),)](
        P, R, S0, starts, finals, table[0], table[1], *P.stride(), *R.stride(), *S0.stride(), HV=HV, K=K, V=V,
        KP=max(16, triton.next_power_of_2(K)), BK=CHAIN_BK, BV=CHAIN_BV, num_warps=CHAIN_WARPS, num_stages=1,
    )  # fmt: skip
    return starts, finals
