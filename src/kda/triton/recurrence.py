"""Stage 2 of the chunk-16 forward: the recurrence, sequential over the chunks of a sequence.

One program per (V slice, sequence, value head). Columns of the KV state (rows of the VK
state) evolve independently, so splitting V across programs multiplies the parallelism of
a long sequence without any exchange between programs. The state slice ``S [K, BV]`` stays
in float32 registers for the whole sequence. Per chunk (``reference.recurrence_step``):

    U      = inverse_beta @ V - w @ S          (the new values; the first product is off the serial path)
    O      = q_decayed @ S + M @ U
    S_next = gamma * S + k_restored^T @ U
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.triton.common import CHUNK, autotune_configs, interpreting

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


@triton.autotune(
    configs=autotune_configs([{"BV": 32}, {"BV": 16}, {"BV": 64}], warps=(4, 2), stages=(2, 1)),
    key=["K", "V", "BK", "MIXED", "PARALLEL_BUCKET"],
)
@triton.jit
def recurrence_v_split_kernel(
    v, o, h0, ht,
    q_decayed, w, k_restored, gamma, inverse_beta, M,
    seq_offsets, chunk_offsets,
    PARALLEL_BUCKET,  # autotune key only: how many (sequence, head) pairs, coarsely
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    MIXED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(seq_offsets + n)
    eos = tl.load(seq_offsets + n + 1)
    c_first = tl.load(chunk_offsets + n)
    c_end = tl.load(chunk_offsets + n + 1)

    rows = tl.arange(0, ROWS)
    rows_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    v_ok = cols_v < V
    state_mask = (rows_k[:, None] < K) & v_ok[None, :]
    if STATE_V_FIRST:  # [N, HV, V, K]
        state_tile = i_nh * K * V + cols_v[None, :] * K + rows_k[:, None]
    else:  # [N, HV, K, V]
        state_tile = i_nh * K * V + rows_k[:, None] * V + cols_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + state_tile, mask=state_mask, other=0.0).to(tl.float32)

    operand_dtype = q_decayed.dtype.element_ty
    for c in tl.range(c_first, c_end):
        tok = bos + (c - c_first) * ROWS + rows
        io_mask = (tok < eos)[:, None] & v_ok[None, :]
        io_tile = (tok[:, None] * HV + i_hv) * V + cols_v[None, :]
        tile = (c * HV + i_hv) * ROWS * BK + rows[:, None] * BK + rows_k[None, :]
        square = (c * HV + i_hv) * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]

        b_v = tl.load(v + io_tile, mask=io_mask, other=0.0)
        b_qd = tl.load(q_decayed + tile)
        b_w = tl.load(w + tile)
        b_kr = tl.load(k_restored + tile)
        b_ib = tl.load(inverse_beta + square)
        b_M = tl.load(M + square)
        b_gamma = tl.load(gamma + (c * HV + i_hv) * BK + rows_k)

        U = tl.dot(b_ib, b_v.to(tl.float32), input_precision=DOT_PRECISION)
        U -= _mm(b_w, S, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        b_o = _mm(b_qd, S, MIXED, operand_dtype, DOT_PRECISION, INTERPRET) + _mm(
            b_M, U, MIXED, operand_dtype, DOT_PRECISION, INTERPRET
        )
        S = b_gamma[:, None] * S + _mm(tl.trans(b_kr), U, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        tl.store(o + io_tile, b_o.to(o.dtype.element_ty), mask=io_mask)

    if STORE_HT:
        tl.store(ht + state_tile, S, mask=state_mask)


def recurrence_v_split(p, tables, ws: dict[str, torch.Tensor], o: torch.Tensor, ht: torch.Tensor | None,
                       mixed: bool, dot_precision: str) -> None:  # fmt: skip
    """Launch the recurrence over every (V slice, sequence, value head); writes o and ht."""
    N, HV = tables.seq_offsets.shape[0] - 1, p.HV
    grid = lambda meta: (triton.cdiv(p.V, meta["BV"]), N * HV)  # noqa: E731
    recurrence_v_split_kernel[grid](
        p.v, o, p.initial_state, ht,
        ws["q_decayed"], ws["w"], ws["k_restored"], ws["gamma"], ws["inverse_beta"], ws["M"],
        tables.seq_offsets, tables.chunk_offsets,
        min(triton.next_power_of_2(N * HV), 1024),
        HV=HV, K=p.K, V=p.V, BK=tables.BK,
        HAS_H0=p.initial_state is not None, STORE_HT=ht is not None, STATE_V_FIRST=p.state_v_first,
        MIXED=mixed, DOT_PRECISION=dot_precision, INTERPRET=interpreting(),
    )  # fmt: skip
