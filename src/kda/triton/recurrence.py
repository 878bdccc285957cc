"""Stage 2 of the chunk-16 forward: the recurrence, sequential over the chunks of a sequence.

One program per (V slice, sequence, value head). Rows of the VK state (columns of the KV
state) evolve independently, so splitting V across programs multiplies the parallelism of
a long sequence without any exchange between programs. The kernel works on the transposed
form (``reference.recurrence_step`` with every product transposed), the state slice
``S^T [BV, K]`` in float32 registers for the whole sequence:

    U^T      = V^T inverse_beta^T - S^T w^T        (the first product is off the serial path)
    O^T      = S^T q_decayed^T + U^T M^T
    S^T_next = S^T Diag(gamma) + U^T k_restored

Why transposed: the state and U are then the *left* operand of every product that reads
them. A tensor-core accumulator already sits in the registers the left operand of the next
MMA needs, so the chain S -> U -> S never leaves registers; as the right operand (the
untransposed form) each step paid two shared-memory round trips on the serial path. The
right operands are all workspace tiles, loaded (transposed where needed) off that path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.intmath import cdiv, next_power_of_2
from kda.tables import CHECKPOINT_CHUNKS, CHUNK
from kda.triton.common import autotune_configs, interpreting

ROWS = tl.constexpr(CHUNK)


@triton.jit
def _mm(a, b, MIXED: tl.constexpr, OPERAND_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr):  # fmt: skip
    """a @ b with a float32 result; MIXED rounds both operands to the 16-bit workspace dtype
    (fastest), otherwise both go in as float32 at DOT_PRECISION (tf32 keeps 3 more bits of
    the state than bf16)."""
    if MIXED:
        a16, b16 = a.to(OPERAND_DTYPE), b.to(OPERAND_DTYPE)
        if INTERPRET:
            # The interpreter multiplies 16-bit operands in float16, which overflows outside
            # its range; the same rounded operands in float32 give the tensor cores' result.
            return tl.dot(a16.to(tl.float32), b16.to(tl.float32), input_precision="ieee")
        return tl.dot(a16, b16)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)


@triton.jit
def state_slice(seq_offsets, chunk_offsets, HV, K, V, BK: tl.constexpr, BV: tl.constexpr,
                STATE_V_FIRST: tl.constexpr):  # fmt: skip
    """What a program of a chain over one (V slice, sequence, value head) starts from: its
    sequence's tokens and chunks, its index vectors, and its slice of an [N, HV, ...] state in
    the caller's layout. Returns ``(n, i_hv, bos, eos, c_first, c_end, rows, rows_k, cols_v,
    v_ok, state_mask, state_tile)``."""
    # One grid dimension (V slices fastest, as a 2-D grid would order them): a second one
    # would stop at 65535 (sequence, value head) pairs.
    pid = tl.program_id(0).to(tl.int64)
    slices_v = tl.cdiv(V, BV)
    i_v, i_nh = pid % slices_v, pid // slices_v
    n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(seq_offsets + n)
    eos = tl.load(seq_offsets + n + 1)
    c_first = tl.load(chunk_offsets + n)
    c_end = tl.load(chunk_offsets + n + 1)
    rows = tl.arange(0, ROWS)
    rows_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    v_ok = cols_v < V
    state_mask = v_ok[:, None] & (rows_k[None, :] < K)
    if STATE_V_FIRST:  # [N, HV, V, K]
        state_tile = i_nh * K * V + cols_v[:, None] * K + rows_k[None, :]
    else:  # [N, HV, K, V]
        state_tile = i_nh * K * V + rows_k[None, :] * V + cols_v[:, None]
    return n, i_hv, bos, eos, c_first, c_end, rows, rows_k, cols_v, v_ok, state_mask, state_tile


STATE_REGISTERS_MAX = 128  # float32 state values per thread; past this ptxas spills and crawls


def _fits_in_registers(configs, named_args, **kwargs):
    """Drop configs whose state slice ``[BV, BK]`` needs more than STATE_REGISTERS_MAX
    registers per thread (BV = 64 on one warp spills, and compiles for minutes)."""
    BK = kwargs.get("BK", named_args.get("BK"))
    kept = [c for c in configs if c.kwargs["BV"] * BK <= STATE_REGISTERS_MAX * 32 * c.num_warps]
    return kept or configs[:1]


@triton.autotune(
    configs=autotune_configs([{"BV": 16}, {"BV": 32}, {"BV": 64}], warps=(1, 2, 4), stages=(2, 3)),
    key=["V", "BK", "MIXED", "PARALLEL_BUCKET"],
    prune_configs_by={"early_config_prune": _fits_in_registers},
)
@triton.jit
def recurrence_v_split_kernel(
    v, o, h0, ht, checkpoints,
    q_decayed, w, k_restored, gamma, inverse_beta, M,
    seq_offsets, chunk_offsets, checkpoint_offsets,
    PARALLEL_BUCKET,  # autotune key only: how many (sequence, head) pairs, coarsely
    HV, K, V,  # runtime: one compiled kernel serves every head count and head size up to BK
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    CHECKPOINT: tl.constexpr,  # 0: inference; else save the state entering every CHECKPOINT-th chunk
    MIXED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    n, i_hv, bos, eos, c_first, c_end, rows, rows_k, cols_v, v_ok, state_mask, state_tile = state_slice(
        seq_offsets, chunk_offsets, HV, K, V, BK, BV, STATE_V_FIRST
    )

    St = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_H0:
        St += tl.load(h0 + state_tile, mask=state_mask, other=0.0).to(tl.float32)
    if CHECKPOINT:
        # [rows, HV, V, K], float32: the backward's starting points (abi.CHECKPOINT_CHUNKS)
        checkpoint_tile = (tl.load(checkpoint_offsets + n) * HV + i_hv) * K * V + cols_v[:, None] * K + rows_k[None, :]

    operand_dtype = q_decayed.dtype.element_ty
    for c in tl.range(c_first, c_end):
        if CHECKPOINT:  # noqa: SIM102 - a constexpr test apart from the runtime one (Triton's `and` is Python's)
            if (c - c_first) % CHECKPOINT == 0:
                tl.store(checkpoints + checkpoint_tile + (c - c_first) // CHECKPOINT * HV * K * V, St, mask=state_mask)
        tok = bos + (c - c_first) * ROWS + rows
        io_mask = v_ok[:, None] & (tok < eos)[None, :]
        io_tile_t = (tok[None, :] * HV + i_hv) * V + cols_v[:, None]  # [BV, 16] view of [16, V]
        base = (c * HV + i_hv) * ROWS * BK
        tile = base + rows[:, None] * BK + rows_k[None, :]  # [16, BK]
        tile_t = base + rows[None, :] * BK + rows_k[:, None]  # [BK, 16]
        square_t = (c * HV + i_hv) * ROWS * ROWS + rows[None, :] * ROWS + rows[:, None]

        b_vt = tl.load(v + io_tile_t, mask=io_mask, other=0.0)
        b_qdt = tl.load(q_decayed + tile_t)
        b_wt = tl.load(w + tile_t)
        b_kr = tl.load(k_restored + tile)
        b_ibt = tl.load(inverse_beta + square_t)
        b_Mt = tl.load(M + square_t)
        b_gamma = tl.load(gamma + (c * HV + i_hv) * BK + rows_k)

        Ut = tl.dot(b_vt.to(tl.float32), b_ibt, input_precision=DOT_PRECISION)
        Ut -= _mm(St, b_wt, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        b_ot = _mm(St, b_qdt, MIXED, operand_dtype, DOT_PRECISION, INTERPRET) + _mm(
            Ut, b_Mt, MIXED, operand_dtype, DOT_PRECISION, INTERPRET
        )
        St = St * b_gamma[None, :] + _mm(Ut, b_kr, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        tl.store(o + io_tile_t, b_ot.to(o.dtype.element_ty), mask=io_mask)

    if STORE_HT:
        tl.store(ht + state_tile, St.to(ht.dtype.element_ty), mask=state_mask)


def recurrence_v_split(p, tables, ws: dict[str, torch.Tensor], o: torch.Tensor, ht: torch.Tensor | None,
                       mixed: bool, dot_precision: str, checkpoints: torch.Tensor | None = None) -> None:  # fmt: skip
    """Launch the recurrence over every (V slice, sequence, value head); writes o and ht, and
    with ``checkpoints`` ([rows, HV, V, K] float32) the training forward's state checkpoints."""
    N, HV = tables.seq_offsets.shape[0] - 1, p.HV
    grid = lambda meta: (cdiv(p.V, meta["BV"]) * N * HV,)  # noqa: E731
    recurrence_v_split_kernel[grid](
        p.v, o, p.initial_state, ht, checkpoints,
        ws["q_decayed"], ws["w"], ws["k_restored"], ws["gamma"], ws["inverse_beta"], ws["M"],
        tables.seq_offsets, tables.chunk_offsets, tables.checkpoint_offsets,
        min(next_power_of_2(N * HV), 1024),
        HV, p.K, p.V, BK=tables.BK,
        HAS_H0=p.initial_state is not None, STORE_HT=ht is not None, STATE_V_FIRST=p.state_v_first,
        CHECKPOINT=0 if checkpoints is None else CHECKPOINT_CHUNKS,
        MIXED=mixed, DOT_PRECISION=dot_precision, INTERPRET=interpreting(),
    )  # fmt: skip
