"""Backward stage 2: every chunk's local gradients, token-parallel, in three kernels.

:func:`chunk_state_grads_kernel`, one program per (chunk, value head), runs the V dimension in
slices, which needs the state S entering the chunk and the gradient dS_next of the state
leaving it (``reference.recurrence_step_backward``):

- S comes from the training forward's checkpoint (the state entering the checkpoint's first
  chunk, ``abi.CHECKPOINT_CHUNKS`` chunks apart), stepped forward through the chunks in
  between with the prepare stage's operands (the forward recurrence's own step);
- dS_next comes from the reverse chain (``state_grad.py``).

Per slice: ``U = inverse_beta V - w S``, ``dU = M^T dO + K^ dS_next`` (stored), and the
slice's share of the products with a state summed over V: ``dQ~ = dO S^T``, ``dw = -dU S^T``,
``dK^ = U dS_next^T`` and ``dgamma = rowsum(S * dS_next)``.

It writes them to float32 scratch. :func:`chunk_du_grads_kernel`, per (chunk, value head),
forms the products of dU that need no state: ``dV = inverse_beta^T dU`` (stored), ``dU V^T``
and ``dO V^T``. :func:`chunk_input_grads_kernel`, one program per (chunk, q/k head) looping
over the value heads that share it (GVA: their dq, dk are summed), recomputes the chunk's
prepare stage in float32 a slice of K at a time (``INPUT_GRAD_SLICE`` columns), takes ``dM =
dO U^T = (dO V^T - dQ~ K~^T) inverse_beta^T`` (U's two terms, so U is never stored) and runs
the prepare stage backwards (``reference.prepare_chunk_backward``): through w and the inverse
to dA, through A and M to k, q and the decay (factored as in the forward where the gate keeps
the exponents in range, pairwise otherwise), the reverse cumulative sum to dg, and through the
in-kernel activations (gate, beta sigmoid, l2norm) to the raw inputs. dA_log and dt_bias,
shared by every token, get per-chunk (and, for dA_log, per-slice) partial sums that the
launcher adds up.

Why the prepare stage's backward is a kernel of its own: in one with the V slices, their
accumulators and the prepare stage's recomputed operands (a dozen 16 x K float32 tiles) were
live together and spilled about 1 KB a thread (ptxas, sm_90); it ran at 5.3 ms of a 6.9 ms
training step on 1x8192 H32 (H200, 2026-12-01). Why the 16 x 16 products of dU left the state
kernel: formed there on the CUDA cores (a tl.dot would pull the chained dots into a layout
that replicates 16-row tiles across warps) each took a [16, 16, BV] temporary; that kernel
took 2.91 ms at 255 registers and 12.5% occupancy, 1.57 ms without them (ncu and the torch
profiler, H200, 2026-12-01). In the prepare-backwards kernel they cost it 0.6 ms more in
spills, so they have a small kernel. Why the prepare-backwards kernel runs in K slices: with
all of K at once it spilled (43 M local-memory requests at 4 warps, ncu); in slices of 32 it
runs the softplus gate's programs in 2.40 ms against 2.78 and the safe gate's in the same
2.03 ms, with 1.6 times the instructions (H200, 2026-12-01, benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.abi import WORKSPACE_BYTES
from kda.intmath import cdiv, next_power_of_2
from kda.tables import CHECKPOINT_CHUNKS, CHUNK, DOT_MIN
from kda.triton.common import autotune_configs, interpreting, safe_gate_path
from kda.triton.prepare import (
    EXP2_LIMIT,
    FAR_LAUNCHES,
    HARD_RESET,
    L2NORM_EPS,
    _row,
    chunk_decays,
    chunk_position,
    load_gate_beta,
    load_rows,
    pair_decay,
    unit_lower_inverse,
)
from kda.triton.recurrence import _mm

ROWS = tl.constexpr(CHUNK)
DU_SLICE = 64  # V columns of dU, V and dO chunk_du_grads_kernel holds at once
# chunk_du_grads_kernel's products: float32 accuracy on the tensor cores (three tf32 products a
# dot). On the CUDA cores ("ieee") the kernel took 0.485 ms of a 5.7 ms training step on
# 1x8192 H32 (H200, 2026-12-01) for about 50 us of float32 FMA work.
DU_PRECISION = tl.constexpr("tf32x3")
# Columns of K chunk_input_grads_kernel holds at once. With all of K at once (a dozen [16, 128]
# float32 tiles live) ptxas gave it 255 registers and 0.9 KB of spill code at 8 warps (sm_90,
# Triton 3.6, 2026-12-01) and the H200 ran it at 12.5% occupancy (benchmarks/NOTES.md).
INPUT_GRAD_SLICE = 32
INTERPRETER_SLICE = 16  # narrower under the interpreter: the CPU tests' K of 24 and 32 take two slices


# K1's workspace (kda.abi.WORKSPACE, kda/cuda/kda_cuda.cuh), which the state-products and dU
# kernels read in place of the Triton prepare stage's when the CUDA reverse chain ran
# (kda.cuda.training, KDA_CUDA_BACKWARD_CHAIN): a block of WORKSPACE_BYTES per (chunk, head),
# read through typed views of each field (kda.cuda.training.k1_operands), so a block is this
# many elements of a bf16 or a float32 view.
K1_BLOCK_BF16 = tl.constexpr(WORKSPACE_BYTES // 2)
K1_BLOCK_F32 = tl.constexpr(WORKSPACE_BYTES // 4)


@triton.jit
def _ws_tile_offsets(r, c, BK: tl.constexpr, K1_LAYOUT: tl.constexpr):
    """``(offsets of elements (r, c) within a [16, BK] workspace tile, elements a block)`` for
    broadcast index tensors r, c: Triton's row-major tiles, or K1's, stored swizzled
    (kda_cuda.cuh tile_offset: 16-byte piece c // 8 of row r at piece c // 8 ^ r % 8; BK = 128)."""
    if K1_LAYOUT:
        offsets = r * BK + ((c // 8) ^ (r % 8)) * 8 + c % 8
        block = K1_BLOCK_BF16
    else:
        offsets = r * BK + c
        block = ROWS * BK
    return offsets, block


@triton.jit
def _ws_square(ptr, lo, block, square, K1_LAYOUT: tl.constexpr, SPLIT: tl.constexpr):
    """A 16 x 16 workspace operand of block ``block`` in float32: Triton's, or K1's bf16 (with
    SPLIT, inverse_beta as its bf16 part plus the bf16 remainder at ``lo``)."""
    if K1_LAYOUT:
        x = tl.load(ptr + block * K1_BLOCK_BF16 + square).to(tl.float32)
        if SPLIT:
            x = x + tl.load(lo + block * K1_BLOCK_BF16 + square).to(tl.float32)
    else:
        x = tl.load(ptr + block * ROWS * ROWS + square)
    return x


@triton.jit
def _ws_gamma(ptr, block, rows_k, BK: tl.constexpr, K1_LAYOUT: tl.constexpr):
    """gamma (exp of the chunk's whole log-decay) of block ``block``, float32 either way."""
    return tl.load(ptr + block * (K1_BLOCK_F32 if K1_LAYOUT else BK) + rows_k)


def input_grad_slice(BK: int) -> int:
    """The K columns per slice of chunk_input_grads_kernel for a padded head size ``BK``."""
    return min(BK, INTERPRETER_SLICE if interpreting() else INPUT_GRAD_SLICE)


def input_grad_slices(K: int, BK: int) -> int:
    """How many slices of K chunk_input_grads_kernel runs (the dA_log partials' last dimension)."""
    return cdiv(K, input_grad_slice(BK))


@triton.jit
def _col(x, rows, j):
    """Column ``j`` of a [16, 16] matrix as a vector, exactly."""
    return tl.sum(tl.where(rows[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _pairs_factored(dAu, dM, b_qd, b_kd, b_kinv, G2, decay, scale, DOT_PRECISION: tl.constexpr):
    """The A and M terms through their factored form ``A_unit = K~ Kinv^T``, ``M = Q~ Kinv^T``:
    ``(dq, dk, dG)`` shares, exact while every ``exp(-G)`` is in range and no reset is met."""
    dqd_m = tl.dot(dM, b_kinv, input_precision=DOT_PRECISION)
    dkd_a = tl.dot(dAu, b_kinv, input_precision=DOT_PRECISION)
    dkinv = tl.dot(tl.trans(dAu), b_kd, input_precision=DOT_PRECISION)
    dkinv += tl.dot(tl.trans(dM), b_qd, input_precision=DOT_PRECISION)
    dq = scale * decay * dqd_m
    dk = decay * dkd_a + tl.exp2(tl.minimum(-G2, EXP2_LIMIT)) * dkinv
    dG = dqd_m * b_qd + dkd_a * b_kd - dkinv * b_kinv
    return dq, dk, dG


@triton.jit
def _pairs_direct(dAu, dM, b_q, b_k, G2, R, scale, rows):
    """The same shares pair by pair, ``exp2(G2_i - G2_j)`` formed from the difference (every
    exponent <= 0): for chunks whose decay passes the factored form's range."""
    dq = tl.zeros(b_q.shape, dtype=tl.float32)
    dk = tl.zeros(b_q.shape, dtype=tl.float32)
    dG = tl.zeros(b_q.shape, dtype=tl.float32)
    for j in tl.range(0, ROWS):  # not unrolled: this rare path would cost half a minute of compile
        k_j = _row(b_k, rows, j)
        d_ij = pair_decay(G2, R, rows, j)  # rows i < j carry zero gradients
        a = _col(dAu, rows, j)
        m = _col(dM, rows, j) * scale
        kd_j = k_j[None, :] * d_ij
        dk += a[:, None] * kd_j  # k_i, row i of the pair
        dq += m[:, None] * kd_j
        through_j = (a[:, None] * b_k + m[:, None] * b_q) * d_ij
        pair = through_j * k_j[None, :]  # d/dG_i of pair (i, j); d/dG_j is its negative
        dk += tl.where(rows[:, None] == j, tl.sum(through_j, axis=0)[None, :], 0.0)  # k_j, column j
        dG += pair - tl.where(rows[:, None] == j, tl.sum(pair, axis=0)[None, :], 0.0)
    return dq, dk, dG


@triton.autotune(  # two stages (the next V slice's loads in flight): the tuner's choice on 1x8192 H32,
    # BV 64 at 4 warps, 1.404 -> 1.376 ms (H200, 2026-12-02, runs 39-40, K1's workspace)
    configs=autotune_configs(
        [{"BV": 32}, {"BV": 64}, {"BV": 32, "maxnreg": 128}, {"BV": 64, "maxnreg": 168}], warps=(4, 8), stages=(1, 2)
    ),
    # K1_LAYOUT in the key: the two layouts' launches tuned apart (with one key, the switched-off CUDA
    # products ran whichever config the first launch had tuned: 2.9-3.0 ms, H200, 2026-12-02, runs 42-43)
    key=["BK", "V", "MIXED", "K1_LAYOUT"],
)
@triton.jit
def chunk_state_grads_kernel(
    v, do, seq_offsets, chunk_offsets, chunk_seq, checkpoint_offsets,
    w, k_restored, gamma, inverse_beta, inverse_beta_lo, M,
    checkpoints, dstates,
    d_u, d_operands, d_gamma_out,
    HV, K, V,
    BK: tl.constexpr, BV: tl.constexpr,
    MIXED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, CHECKPOINT: tl.constexpr,
    K1_LAYOUT: tl.constexpr,
):  # fmt: skip
    """The V slices of one (chunk, value head): dU, and the products with S and dS_next summed
    over V. The big ones are formed transposed, ``[K, 16] = [K, BV] @ [BV, 16]``, so that the
    state slice is the left operand and the warps split K (a 16-row result would be replicated
    across them)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    n, bos, eos, c_first, t0 = chunk_position(chunk_seq, seq_offsets, chunk_offsets, i_c)
    if t0 >= eos:  # a slot past the real chunks (kda.tables)
        return
    c_from = i_c - (i_c - c_first) % CHECKPOINT  # first chunk of this chunk's checkpoint
    checkpoint_row = tl.load(checkpoint_offsets + n) + (i_c - c_first) // CHECKPOINT

    rows = tl.arange(0, ROWS)
    rows_k = tl.arange(0, BK)
    tok = t0 + rows
    row_ok = tok < eos
    k_ok = rows_k < K
    square = rows[:, None] * ROWS + rows[None, :]
    tile, tile_block = _ws_tile_offsets(rows[:, None], rows_k[None, :], BK, K1_LAYOUT)  # [16, BK] of an operand
    tile_t, _ = _ws_tile_offsets(rows[None, :], rows_k[:, None], BK, K1_LAYOUT)  # [BK, 16]
    operand_dtype = w.dtype.element_ty
    ws = i_c * HV + i_hv
    b_w = tl.load(w + ws * tile_block + tile)
    b_kr = tl.load(k_restored + ws * tile_block + tile)
    b_ib = _ws_square(inverse_beta, inverse_beta_lo, ws, square, K1_LAYOUT, True)
    b_M = _ws_square(M, M, ws, square, K1_LAYOUT, False)

    d_qdt = tl.zeros([BK, ROWS], dtype=tl.float32)
    d_wt = tl.zeros([BK, ROWS], dtype=tl.float32)
    d_krt = tl.zeros([BK, ROWS], dtype=tl.float32)
    # [BK, 1], summed with keep_dims: the row sums then stay in the state's MMA layout; summed to
    # [BK] they took a [BK, BV] float32 layout conversion through shared memory every slice
    # (ptxas, sm_90, Triton 3.6, 2026-12-02: BV 32 at 4 warps 255 -> 246 registers, 1512 -> 1392
    # SASS instructions; at 8 warps 210 -> 198)
    d_gamma = tl.zeros([BK, 1], dtype=tl.float32)
    for i_v in tl.range(0, tl.cdiv(V, BV)):
        cols_v = i_v * BV + tl.arange(0, BV)
        v_ok = cols_v < V
        state_mask = k_ok[:, None] & v_ok[None, :]
        state_kv = i_hv * K * V + cols_v[None, :] * K + rows_k[:, None]  # [BK, BV] of a [.., HV, V, K] tensor
        S = tl.load(checkpoints + checkpoint_row * HV * K * V + state_kv, mask=state_mask, other=0.0)
        for c2 in tl.range(c_from, i_c):  # the forward's step over the chunks in between
            tok2 = bos + (c2 - c_first) * ROWS + rows
            ws2 = c2 * HV + i_hv
            b_v2 = tl.load(v + (tok2[:, None] * HV + i_hv) * V + cols_v[None, :],
                           mask=(tok2 < eos)[:, None] & v_ok[None, :], other=0.0)  # fmt: skip
            U2 = tl.dot(_ws_square(inverse_beta, inverse_beta_lo, ws2, square, K1_LAYOUT, True),
                        b_v2.to(tl.float32), input_precision=DOT_PRECISION)  # fmt: skip
            U2 -= _mm(tl.load(w + ws2 * tile_block + tile), S, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
            S = S * _ws_gamma(gamma, ws2, rows_k, BK, K1_LAYOUT)[:, None] + _mm(
                tl.load(k_restored + ws2 * tile_block + tile_t), U2, MIXED, operand_dtype, DOT_PRECISION, INTERPRET
            )
        io_mask = row_ok[:, None] & v_ok[None, :]
        io = (tok[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_v = tl.load(v + io, mask=io_mask, other=0.0).to(tl.float32)
        b_do = tl.load(do + io, mask=io_mask, other=0.0).to(tl.float32)
        if K1_LAYOUT:  # the CUDA chain's dS: each row's 16-byte pieces swizzled as K1's tiles (K = 128)
            ds_kv = i_hv * K * V + cols_v[None, :] * K + ((rows_k[:, None] // 8) ^ (cols_v[None, :] % 8)) * 8
            ds_kv += rows_k[:, None] % 8
        else:
            ds_kv = state_kv
        dS = tl.load(dstates + i_c * HV * K * V + ds_kv, mask=state_mask, other=0.0).to(tl.float32)

        U = tl.dot(b_ib, b_v, input_precision=DOT_PRECISION) - _mm(
            b_w, S, MIXED, operand_dtype, DOT_PRECISION, INTERPRET
        )
        dU = tl.dot(tl.trans(b_M), b_do, input_precision=DOT_PRECISION) + _mm(
            b_kr, dS, MIXED, operand_dtype, DOT_PRECISION, INTERPRET
        )
        tl.store(d_u + ws * ROWS * V + rows[:, None] * V + cols_v[None, :], dU, mask=v_ok[None, :])
        d_qdt += _mm(S, tl.trans(b_do), MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        d_wt += _mm(S, tl.trans(-dU), MIXED, operand_dtype, DOT_PRECISION, INTERPRET)  # accumulated in the MMA
        d_krt += _mm(dS, tl.trans(U), MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        d_gamma += tl.sum(S * dS, axis=1, keep_dims=True)

    # [3, NC, HV, 16, BK] operand gradients (Q~, w, K^), [NC, HV, BK] gamma's
    out_t = rows[None, :] * BK + rows_k[:, None]  # [BK, 16] of a row-major [16, BK] block
    plane = tl.num_programs(0).to(tl.int64) * HV * ROWS * BK
    tl.store(d_operands + ws * ROWS * BK + out_t, d_qdt)
    tl.store(d_operands + plane + ws * ROWS * BK + out_t, d_wt)
    tl.store(d_operands + 2 * plane + ws * ROWS * BK + out_t, d_krt)
    tl.store(d_gamma_out + ws * BK + rows_k[:, None], d_gamma)


# two stages: the tuner's choice on 1x8192 H32, 0.183 -> 0.146 ms (H200, 2026-12-02, run 41)
@triton.autotune(configs=autotune_configs([{}], warps=(4, 2), stages=(1, 2)), key=["BV", "K1_LAYOUT"])
@triton.jit
def chunk_du_grads_kernel(
    v, do, seq_offsets, chunk_offsets, chunk_seq, inverse_beta, inverse_beta_lo, d_u, dv, d_squares, HV, V,
    BV: tl.constexpr, K1_LAYOUT: tl.constexpr,
):  # fmt: skip
    """dU's products over V that need no state, one (chunk, value head): ``dV = inverse_beta^T
    dU`` (stored), ``dU V^T`` and ``dO V^T`` (to ``d_squares`` [2, NC, HV, 16, 16]), in
    ``DU_PRECISION``."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    _n, _bos, eos, _first, t0 = chunk_position(chunk_seq, seq_offsets, chunk_offsets, i_c)
    if t0 >= eos:
        return
    rows = tl.arange(0, ROWS)
    tok = t0 + rows
    row_ok = tok < eos
    ws = i_c * HV + i_hv
    square = ws * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]  # of d_squares
    b_ibt = tl.trans(
        _ws_square(inverse_beta, inverse_beta_lo, ws, rows[:, None] * ROWS + rows[None, :], K1_LAYOUT, True)
    )
    du_vt = tl.zeros([ROWS, ROWS], dtype=tl.float32)
    do_vt = tl.zeros([ROWS, ROWS], dtype=tl.float32)
    for i_v in tl.range(0, tl.cdiv(V, BV)):
        cols_v = i_v * BV + tl.arange(0, BV)
        v_ok = cols_v < V
        io_mask = row_ok[:, None] & v_ok[None, :]
        io = (tok[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_vt = tl.trans(tl.load(v + io, mask=io_mask, other=0.0).to(tl.float32))
        b_du = tl.load(d_u + ws * ROWS * V + rows[:, None] * V + cols_v[None, :], mask=v_ok[None, :], other=0.0)
        du_vt += tl.dot(b_du, b_vt, input_precision=DU_PRECISION)
        do_vt += tl.dot(tl.load(do + io, mask=io_mask, other=0.0).to(tl.float32), b_vt, input_precision=DU_PRECISION)
        tl.store(dv + io, tl.dot(b_ibt, b_du, input_precision=DU_PRECISION).to(dv.dtype.element_ty), mask=io_mask)
    tl.store(d_squares + square, du_vt)
    tl.store(d_squares + tl.num_programs(0).to(tl.int64) * HV * ROWS * ROWS + square, do_vt)


@triton.jit
def _sum_before_last(s1, l1, s2, l2):
    """Joins two runs of rows, each as (sum of all rows but its last, its last row)."""
    return s1 + l1 + s2, l2


@triton.jit
def _exclusive_cumsum(x):
    """``sum_{i < t} x_i`` for every row t (row 0 gets 0): no difference of two sums, so nothing
    cancels. Formed as a scan rather than a product with the strictly lower ones: that float32
    dot on the CUDA cores held its constant operand in registers across the passes (ptxas at the
    autotuner's maxnreg 168: 224 -> 40 B of spill stores for the safe gate; sm_90, Triton 3.6,
    2026-12-02)."""
    before, _last = tl.associative_scan((tl.zeros(x.shape, x.dtype), x), 0, _sum_before_last)
    return before


@triton.jit
def _pair_products(b_k, G2, R, rows):
    """``sum_c k_ic k_jc exp(G_ic - G_jc)`` over the columns of a slice for every pair (i, j),
    formed from the differences (every exponent <= 0): A's unit form where the factored one
    cannot hold (rows i < j are the caller's to mask)."""
    A_pair = tl.zeros([ROWS, ROWS], dtype=tl.float32)
    for j in tl.static_range(ROWS):
        a_col = tl.sum(b_k * (_row(b_k, rows, j)[None, :] * pair_decay(G2, R, rows, j)), axis=1)
        A_pair = tl.where(rows[None, :] == j, a_col[:, None], A_pair)
    return A_pair


# Uncapped, ptxas takes ~250 registers at 4 or 8 warps whatever SLICE is: what fills them is mostly
# loop invariants it keeps live across the passes (the per-thread shared-memory addresses of the
# layout conversions, masks, a constant dot operand), not the slices; its figure at a cap (spill
# bytes at maxnreg 168 and 128) is what the changes move (sm_90, Triton 3.6, 2026-12-02).
@triton.autotune(
    # 2 warps (255 registers, 6 B of spills, four programs an SM) is the tuner's choice on 1x8192
    # H32: 1.615 ms (H200, 2026-12-02, run 33) against 1.693 for 4 warps at maxnreg 168 (run 29);
    # with two stages (the next K slice's loads in flight) 1.626 -> 1.440 ms (runs 39-40)
    # (three stages, offered in run 41, were not chosen)
    configs=autotune_configs([{}, {"maxnreg": 168}, {"maxnreg": 128}], warps=(4, 8, 2), stages=(1, 2)),
    key=["BK", "SLICE", "GATE", "SAFE", "PAIRWISE"],
    # The kernel rewrites these two as it goes (below): the tuner runs it once for each config it
    # times, so each timing must start from the call's own values, and the chosen config's run too.
    # Without this a training call on a cold cache got wrong gradients (dq of order 1e-23 in place
    # of one: H100, 2026-12-06, run 171). The cost falls on a tuning only: both copied a timed run.
    restore_value=["d_operands", "d_squares"],
)
@triton.jit
def chunk_input_grads_kernel(
    q, k, g, beta, A_log, dt_bias,
    seq_offsets, chunk_offsets, chunk_seq,
    d_operands, d_squares, d_gamma_in,
    dq, dk, dg, dbeta, dA_log_part, ddt_bias_part, far,
    scale, lower_bound, beta_scale,
    H, HV, K,
    BK: tl.constexpr, SLICE: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, SAFE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAIRWISE: tl.constexpr,
):  # fmt: skip
    """The prepare stage of one (chunk, q/k head) run backwards for each value head that shares
    the q/k head, from the operand gradients of :func:`chunk_state_grads_kernel`, ``SLICE``
    columns of K at a time (no [16, K] float32 tile is live; see ``INPUT_GRAD_SLICE``).

    Three passes over the slices. (1) Per value head, the sums over K: ``A_unit = K~ Kinv^T``,
    ``d_w K~^T`` and ``dQ~ K~^T``; then the 16 x 16 algebra (the inverse, dA, d beta, dM),
    whose results (inverse_beta, and dM with dA_unit^T packed above its diagonal) overwrite
    that value head's two ``d_squares`` matrices once read. (2) Per slice, every value head's
    column-wise gradients (dq, dk summed over the group, dg and the gate's parameters). (3)
    With l2norm, its row sums need every column: (2) leaves dq^, dk^ in the d_operands rows
    of the group's first value head (read by then), and (3) applies the norm's backward.

    Without SAFE it runs as two launches (``prepare.FAR_LAUNCHES``), from the forward's flags
    ``far[chunk, value head]``: the first skips every program with a flagged value head and
    runs the others without the pairwise path; the second runs only those, with it (for all of
    their rows: exact for every row, the factored form only within its range). A skipped
    program writes nothing, so the second finds its inputs intact."""
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    # Named, not `_`: the loops below assign tensors, and Triton gives a variable one type.
    _n, _bos, eos, _first, t0 = chunk_position(chunk_seq, seq_offsets, chunk_offsets, i_c)
    if t0 >= eos:
        return
    group = HV // H
    if not SAFE:
        program_far = tl.zeros([], dtype=tl.int32)
        for i_g in tl.range(0, group):
            program_far = tl.maximum(program_far, tl.load(far + i_c * HV + i_h * group + i_g).to(tl.int32))
        if PAIRWISE:
            if program_far == 0:
                return
        elif program_far != 0:
            return
    rows = tl.arange(0, ROWS)
    tok = t0 + rows
    row_ok = tok < eos
    plane = tl.num_programs(0).to(tl.int64) * HV * ROWS * BK
    square_plane = tl.num_programs(0).to(tl.int64) * HV * ROWS * ROWS
    slices = tl.cdiv(K, SLICE)
    lower = rows[:, None] > rows[None, :]

    q_rstd = tl.full([ROWS], 1.0, tl.float32)
    k_rstd = tl.full([ROWS], 1.0, tl.float32)
    if L2NORM:
        q_sq = tl.zeros([ROWS], dtype=tl.float32)
        k_sq = tl.zeros([ROWS], dtype=tl.float32)
        for s in tl.range(0, slices):
            cols = s * SLICE + tl.arange(0, SLICE)
            col_ok = cols < K
            b_q = load_rows(q, tok, row_ok, cols, col_ok, i_h, H, K)
            b_k = load_rows(k, tok, row_ok, cols, col_ok, i_h, H, K)
            q_sq += tl.sum(b_q * b_q, axis=1)
            k_sq += tl.sum(b_k * b_k, axis=1)
        q_rstd = tl.rsqrt(q_sq + L2NORM_EPS)
        k_rstd = tl.rsqrt(k_sq + L2NORM_EPS)

    # ---- pass 1: per value head, the sums over K and the 16 x 16 algebra
    for i_g in tl.range(0, group):
        i_hv = i_h * group + i_g
        ws = i_c * HV + i_hv
        A_unit = tl.zeros([ROWS, ROWS], dtype=tl.float32)
        dw_kd = tl.zeros([ROWS, ROWS], dtype=tl.float32)  # d_w K~^T
        dqd_kd = tl.zeros([ROWS, ROWS], dtype=tl.float32)  # dQ~ K~^T
        b_beta = tl.zeros([ROWS], dtype=tl.float32)
        b_raw = tl.zeros([ROWS], dtype=tl.float32)
        for s in tl.range(0, slices):
            cols = s * SLICE + tl.arange(0, SLICE)
            col_ok = cols < K
            b_k = load_rows(k, tok, row_ok, cols, col_ok, i_h, H, K) * k_rstd[:, None]
            b_g, b_beta, _x, _a, b_raw = load_gate_beta(
                g, beta, A_log, dt_bias, tok, row_ok, cols, col_ok, i_hv, HV, K, lower_bound, beta_scale,
                GATE, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID,
            )  # fmt: skip
            G2, R, decay, _to_end, _whole = chunk_decays(b_g, rows, SAFE)
            b_kd = b_k * decay
            if PAIRWISE:
                A_unit += _pair_products(b_k, G2, R, rows)
            else:
                b_kinv = b_k * tl.exp2(tl.minimum(-G2, EXP2_LIMIT))
                A_unit += tl.dot(b_kd, tl.trans(b_kinv), input_precision=DOT_PRECISION)
            tile = ws * ROWS * BK + rows[:, None] * BK + cols[None, :]
            dw_kd += tl.dot(tl.load(d_operands + plane + tile), tl.trans(b_kd), input_precision=DOT_PRECISION)
            dqd_kd += tl.dot(tl.load(d_operands + tile), tl.trans(b_kd), input_precision=DOT_PRECISION)
        A_unit = tl.where(lower, A_unit, 0.0)
        T = unit_lower_inverse(A_unit * b_beta[:, None], rows)
        b_ib = T * b_beta[None, :]  # inverse_beta = T Diag(beta)
        square = ws * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]
        # w = inverse_beta K~ gives d inverse_beta its d_w K~^T; A = Diag(beta) A_unit; dA = -T^T dT T^T
        d_ib = tl.load(d_squares + square) + dw_kd
        d_beta = tl.sum(T * d_ib, axis=0)
        Tt = tl.trans(T)
        dA = -tl.dot(tl.dot(Tt, d_ib * b_beta[None, :], input_precision="ieee"), Tt, input_precision="ieee")
        dA = tl.where(lower, dA, 0.0)
        d_beta += tl.sum(dA * A_unit, axis=1)
        # dM = dO U^T = dO (inverse_beta V - w S)^T = (dO V^T - dQ~ K~^T) inverse_beta^T (dO V^T and dU V^T
        # from chunk_du_grads_kernel)
        d_M = tl.dot(tl.load(d_squares + square_plane + square) - dqd_kd, tl.trans(b_ib), input_precision="ieee")
        packed = tl.where(rows[:, None] >= rows[None, :], d_M, tl.trans(dA * b_beta[:, None]))
        if BETA_SIGMOID:
            s_b = tl.sigmoid(b_raw)
            d_beta = d_beta * beta_scale * s_b * (1.0 - s_b)
        tl.store(dbeta + tok * HV + i_hv, d_beta.to(dbeta.dtype.element_ty), mask=row_ok)
        tl.debug_barrier()  # every thread has read both matrices before they are overwritten
        tl.store(d_squares + square, b_ib)
        tl.store(d_squares + square_plane + square, packed)
    tl.debug_barrier()

    # ---- pass 2: per slice, the column-wise gradients of every value head
    q_dot = tl.zeros([ROWS], dtype=tl.float32)  # l2norm's row sums: dq^ . q^, dk^ . k^
    k_dot = tl.zeros([ROWS], dtype=tl.float32)
    for s in tl.range(0, slices):
        cols = s * SLICE + tl.arange(0, SLICE)
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        b_q = load_rows(q, tok, row_ok, cols, col_ok, i_h, H, K) * q_rstd[:, None]
        b_k = load_rows(k, tok, row_ok, cols, col_ok, i_h, H, K) * k_rstd[:, None]
        dq_hat = tl.zeros([ROWS, SLICE], dtype=tl.float32)  # summed over the group's value heads
        dk_hat = tl.zeros([ROWS, SLICE], dtype=tl.float32)
        for i_g in tl.range(0, group):
            i_hv = i_h * group + i_g
            ws = i_c * HV + i_hv
            b_g, _beta, x, a, _raw = load_gate_beta(
                g, beta, A_log, dt_bias, tok, row_ok, cols, col_ok, i_hv, HV, K, lower_bound, beta_scale,
                GATE, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID,
            )  # fmt: skip
            G2, R, decay, to_end, whole = chunk_decays(b_g, rows, SAFE)
            b_qd = b_q * decay * scale  # Q~
            b_kd = b_k * decay  # K~
            b_kr = b_k * to_end  # K^
            tile = ws * ROWS * BK + rows[:, None] * BK + cols[None, :]
            d_qd = tl.load(d_operands + tile)
            d_w = tl.load(d_operands + plane + tile)
            d_kr = tl.load(d_operands + 2 * plane + tile)
            square = ws * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]
            packed = tl.load(d_squares + square_plane + square)
            # M's diagonal (exp(G_i - G_i) = 1) has no decay to differentiate: split off, it adds to
            # q and k alone, and the exponents' shares below cancel nothing on it. It and
            # inverse_beta^T are read as such from memory (L1), not picked out of the square
            # (a sum over its columns) and transposed in registers: ptxas at maxnreg 168, 40 -> 8 B
            # of spill stores (safe gate; sm_90, Triton 3.6, 2026-12-02).
            d_M_diag = tl.load(d_squares + square_plane + ws * ROWS * ROWS + rows * (ROWS + 1)) * scale
            d_M = tl.where(lower, packed, 0.0)
            dAu = tl.where(lower, tl.trans(packed), 0.0)
            b_ibt = tl.load(d_squares + ws * ROWS * ROWS + rows[None, :] * ROWS + rows[:, None])
            d_kd = tl.dot(b_ibt, d_w, input_precision=DOT_PRECISION)
            if PAIRWISE:
                dq_pair, dk_pair, dG_pair = _pairs_direct(dAu, d_M, b_q, b_k, G2, R, scale, rows)
            else:
                b_kinv = b_k * tl.exp2(tl.minimum(-G2, EXP2_LIMIT))
                dq_pair, dk_pair, dG_pair = _pairs_factored(dAu, d_M, b_qd, b_kd, b_kinv, G2, decay, scale,
                                                            DOT_PRECISION)  # fmt: skip
            dq_hat += scale * decay * d_qd + dq_pair + d_M_diag[:, None] * b_k
            dk_hat += decay * d_kd + to_end * d_kr + dk_pair + d_M_diag[:, None] * b_q
            # dg_t = sum over rows i >= t of dG_i (G = cumsum(g)), plus the terms whose exponent is a
            # sum of later rows: K^_i's exp(G_last - G_i) takes every g_t with t > i (a prefix sum
            # over i < t, summed as such: written as G_last minus G_i, the two would cancel in floating
            # point), gamma's exp(G_last) takes every row.
            dG = d_qd * b_qd + d_kd * b_kd + dG_pair
            d_g = tl.cumsum(dG, axis=0, reverse=True) + _exclusive_cumsum(d_kr * b_kr)
            d_g += (tl.load(d_gamma_in + ws * BK + cols) * whole)[None, :]
            if not SAFE:  # a reset step's decay is 0 for every g below HARD_RESET: no gradient
                d_g = tl.where(b_g < HARD_RESET, 0.0, d_g)

            # ---- the in-kernel gate
            if GATE == 1:  # g = lb sigmoid(z), z = a x
                sig = tl.sigmoid(a * x)
                d_z = tl.where(mask, d_g * lower_bound * sig * (1.0 - sig), 0.0)
                d_x = d_z * a
                if HAS_A_LOG:  # d_z is exactly 0 where the sigmoid saturates, x = +-inf among them: not 0 * inf
                    d_a = d_z * a * tl.where(d_z == 0.0, 0.0, x)
                    tl.store(dA_log_part + ws * slices + s, tl.sum(tl.sum(d_a, axis=1), axis=0))
            elif GATE == 2:  # g = -a softplus(x)
                d_x = tl.where(mask, -a * d_g * tl.sigmoid(x), 0.0)
                if HAS_A_LOG:  # b_g is 0 off the chunk's rows and columns
                    tl.store(dA_log_part + ws * slices + s, tl.sum(tl.sum(d_g * b_g, axis=1), axis=0))
            else:
                d_x = d_g
            if GATE != 0 and HAS_DT_BIAS:
                tl.store(ddt_bias_part + ws * K + cols, tl.sum(d_x, axis=0), mask=col_ok)
            tl.store(dg + (tok[:, None] * HV + i_hv) * K + cols[None, :], d_x.to(dg.dtype.element_ty), mask=mask)

        io = (tok[:, None] * H + i_h) * K + cols[None, :]
        if L2NORM:  # dq^, dk^ wait for the row sums, in the group's first value head's d_operands rows
            q_dot += tl.sum(b_q * dq_hat, axis=1)
            k_dot += tl.sum(b_k * dk_hat, axis=1)
            held = (i_c * HV + i_h * group) * ROWS * BK + rows[:, None] * BK + cols[None, :]
            tl.debug_barrier()  # this slice of those rows is read by every thread before it is overwritten
            tl.store(d_operands + held, dq_hat)
            tl.store(d_operands + plane + held, dk_hat)
        else:
            tl.store(dq + io, dq_hat.to(dq.dtype.element_ty), mask=mask)
            tl.store(dk + io, dk_hat.to(dk.dtype.element_ty), mask=mask)

    # ---- pass 3, l2norm: x^ = x r, dx = r (dx^ - x^ sum(x^ dx^))
    if L2NORM:
        tl.debug_barrier()
        for s in tl.range(0, slices):
            cols = s * SLICE + tl.arange(0, SLICE)
            col_ok = cols < K
            mask = row_ok[:, None] & col_ok[None, :]
            held = (i_c * HV + i_h * group) * ROWS * BK + rows[:, None] * BK + cols[None, :]
            b_q = load_rows(q, tok, row_ok, cols, col_ok, i_h, H, K) * q_rstd[:, None]
            b_k = load_rows(k, tok, row_ok, cols, col_ok, i_h, H, K) * k_rstd[:, None]
            d_q = q_rstd[:, None] * (tl.load(d_operands + held) - b_q * q_dot[:, None])
            d_k = k_rstd[:, None] * (tl.load(d_operands + plane + held) - b_k * k_dot[:, None])
            io = (tok[:, None] * H + i_h) * K + cols[None, :]
            tl.store(dq + io, d_q.to(dq.dtype.element_ty), mask=mask)
            tl.store(dk + io, d_k.to(dk.dtype.element_ty), mask=mask)


def state_products(p, tables, ws: dict[str, torch.Tensor], do: torch.Tensor, checkpoints: torch.Tensor,
                   dstates: torch.Tensor, mixed: bool, dot_precision: str, k1_layout: bool,
                   scratch: torch.Tensor, dv: torch.Tensor) -> None:  # fmt: skip
    """The state and dU kernels: ``scratch`` (float32, the layout :func:`local_products` returns: the
    operand gradients [3, NC, HV, 16, BK], the squares [2, NC, HV, 16, 16], dgamma [NC, HV,
    BK]) and ``dv``. With ``k1_layout``, ``ws`` is K1's workspace and ``dstates`` the CUDA
    chain's (rows swizzled, kda.cuda.training.dstates_row_major). kda.cuda.training.state_products
    writes the same on the CUDA path."""
    NC, HV, BK = tables.num_chunks, p.HV, tables.BK
    d_operands, d_squares, d_gamma = scratch_views(scratch, NC, HV, BK)
    d_u = p.q.new_empty(NC, HV, CHUNK, p.V, dtype=torch.float32)
    chunk_state_grads_kernel[(NC, HV)](
        p.v, do, tables.seq_offsets, tables.chunk_offsets, tables.chunk_seq, tables.checkpoint_offsets,
        ws["w"], ws["k_restored"], ws["gamma"], ws["inverse_beta"], ws.get("inverse_beta_lo"), ws["M"],
        checkpoints, dstates,
        d_u, d_operands, d_gamma,
        HV, p.K, p.V, BK=BK,
        MIXED=mixed, DOT_PRECISION=dot_precision, INTERPRET=interpreting(), CHECKPOINT=CHECKPOINT_CHUNKS,
        K1_LAYOUT=k1_layout,
    )  # fmt: skip
    chunk_du_grads_kernel[(NC, HV)](
        p.v, do, tables.seq_offsets, tables.chunk_offsets, tables.chunk_seq, ws["inverse_beta"],
        ws.get("inverse_beta_lo"), d_u, dv, d_squares, HV, p.V,
        BV=max(min(next_power_of_2(p.V), DU_SLICE), DOT_MIN), K1_LAYOUT=k1_layout,
    )  # fmt: skip


def scratch_numel(NC: int, HV: int, BK: int) -> int:
    """Float32 elements of the local-gradient scratch :func:`scratch_views` lays out."""
    return NC * HV * (CHUNK * (3 * BK + 2 * CHUNK) + BK)


def scratch_views(scratch: torch.Tensor, NC: int, HV: int, BK: int) -> tuple[torch.Tensor, ...]:
    """``(d_operands [3, NC, HV, 16, BK], d_squares [2, NC, HV, 16, 16], d_gamma [NC, HV, BK])``,
    back to back in one float32 ``scratch`` of :func:`scratch_numel` elements (the order
    kda.cuda.training.state_products writes)."""
    plane = NC * HV * CHUNK
    squares_at, gamma_at = 3 * plane * BK, plane * (3 * BK + 2 * CHUNK)
    return (
        scratch[:squares_at].view(3, NC, HV, CHUNK, BK),
        scratch[squares_at:gamma_at].view(2, NC, HV, CHUNK, CHUNK),
        scratch[gamma_at:].view(NC, HV, BK),
    )


def local_products(p, tables, ws: dict[str, torch.Tensor], do: torch.Tensor, checkpoints: torch.Tensor,
                   dstates: torch.Tensor, dv: torch.Tensor, mixed: bool, dot_precision: str,
                   k1_layout: bool = False, cuda_products=None) -> torch.Tensor:  # fmt: skip
    """The local gradients' first half, per (chunk, value head): the state products. Writes ``dv``
    and returns the float32 scratch of the operand gradients (3 x 16 x BK + 2 x 16 x 16 + BK
    values per chunk and value head, :func:`scratch_views`) that :func:`input_grads` reads; the
    last reader of ``dstates``, ``checkpoints`` and of ``ws`` but its far-row flags (the training
    backward frees them between the halves). ``ws`` is the Triton prepare stage's workspace, or
    with ``k1_layout`` K1's as ``kda.cuda.training.k1_operands`` views it (bf16, K = V = 128).
    ``cuda_products``: a callable ``(scratch, dv)`` writing the state products in place of
    :func:`state_products` (kda.cuda.training.state_products), or None."""
    NC, HV, BK = tables.num_chunks, p.HV, tables.BK
    scratch = p.q.new_empty(scratch_numel(NC, HV, BK), dtype=torch.float32)
    if cuda_products is not None:
        cuda_products(scratch, dv)
    else:
        state_products(p, tables, ws, do, checkpoints, dstates, mixed, dot_precision, k1_layout, scratch, dv)
    return scratch


def input_grads(p, tables, far: torch.Tensor | None, scratch: torch.Tensor, grads: dict[str, torch.Tensor],
                dot_precision: str) -> None:  # fmt: skip
    """The local gradients' second half, per (chunk, q/k head): the prepare stage backwards from
    :func:`local_products`' ``scratch``. Writes ``grads`` q, k, g, beta and the per-chunk partials
    dA_log [NC, HV, slices of K], dt_bias [NC, HV, K] where the gate has them.
    Of the workspace it reads only ``far`` (the Triton prepare stage's far-row flags, where the
    gate is not the safe one): it recomputes the prepare stage itself."""
    NC, HV, BK = tables.num_chunks, p.HV, tables.BK
    d_operands, d_squares, d_gamma = scratch_views(scratch, NC, HV, BK)
    gate = {"precomputed": 0, "lower_bound": 1, "softplus": 2}[p.gate_form]
    safe = safe_gate_path(p)
    for pairwise in (False,) if safe else FAR_LAUNCHES:
        chunk_input_grads_kernel[(NC, p.H)](
            p.q, p.k, p.g, p.beta, p.A_log, p.dt_bias,
            tables.seq_offsets, tables.chunk_offsets, tables.chunk_seq,
            d_operands, d_squares, d_gamma,
            grads["q"], grads["k"], grads["g"], grads["beta"], grads.get("A_log"), grads.get("dt_bias"), far,
            p.scale, p.lower_bound if p.lower_bound is not None else 0.0, 2.0 if p.allow_neg_eigval else 1.0,
            p.H, HV, p.K, BK=BK, SLICE=input_grad_slice(BK),
            GATE=gate, HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
            L2NORM=p.use_qk_l2norm, BETA_SIGMOID=p.use_beta_sigmoid, SAFE=safe,
            DOT_PRECISION=dot_precision, PAIRWISE=pairwise,
        )  # fmt: skip
