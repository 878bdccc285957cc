"""Backward stage 1: the reverse chain of the state gradient, sequential over the chunks of a
sequence from the last to the first.

The gradient of the state leaving a chunk, dS_next, flows into the state entering it
(``reference.recurrence_step_backward``):

    dU = M^T dO + K^ dS_next
    dS = Q~^T dO + Diag(gamma) dS_next - w^T dU

No forward state appears, so this chain needs only the prepare stage's operands and dO. Like
the forward recurrence it runs one program per (V slice, sequence, value head), on the
transposed form, the slice ``dS^T [BV, K]`` in float32 registers:

    dU^T = dO^T M + dS_next^T K^^T
    dS^T = dO^T Q~ + dS_next^T Diag(gamma) - dU^T w

It writes dS_next of every chunk (what the chunk's local gradients need, in the workspace
dtype) and, at the sequence start, the gradient of the initial state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.intmath import cdiv, next_power_of_2
from kda.tables import CHUNK
from kda.triton.common import autotune_configs, interpreting
from kda.triton.recurrence import _fits_in_registers, _mm, state_slice

ROWS = tl.constexpr(CHUNK)


@triton.autotune(  # the forward recurrence's tuning picked 1-2 warps and 3 stages on every H200 case
    configs=autotune_configs([{"BV": 32}, {"BV": 16}, {"BV": 64}], warps=(2, 1), stages=(3,)),
    key=["V", "BK", "MIXED", "PARALLEL_BUCKET"],
    prune_configs_by={"early_config_prune": _fits_in_registers},
)
@triton.jit
def state_grad_chain_kernel(
    do, dht, dh0, dstates,
    q_decayed, w, k_restored, gamma, M,
    seq_offsets, chunk_offsets,
    PARALLEL_BUCKET,  # autotune key only: how many (sequence, head) pairs, coarsely
    HV, K, V,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    MIXED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    n, i_hv, bos, eos, c_first, c_end, rows, rows_k, cols_v, v_ok, state_mask, state_tile = state_slice(
        seq_offsets, chunk_offsets, HV, K, V, BK, BV, STATE_V_FIRST
    )
    dstate_tile = i_hv * K * V + cols_v[:, None] * K + rows_k[None, :]  # [NC, HV, V, K]

    dSt = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_DHT:
        dSt += tl.load(dht + state_tile, mask=state_mask, other=0.0).to(tl.float32)

    operand_dtype = q_decayed.dtype.element_ty
    for i in tl.range(0, c_end - c_first):
        c = c_end - 1 - i
        tl.store(dstates + c * HV * K * V + dstate_tile, dSt.to(dstates.dtype.element_ty), mask=state_mask)
        tok = bos + (c - c_first) * ROWS + rows
        io_mask = v_ok[:, None] & (tok < eos)[None, :]
        b_dot = tl.load(do + (tok[None, :] * HV + i_hv) * V + cols_v[:, None], mask=io_mask, other=0.0)
        base = (c * HV + i_hv) * ROWS * BK
        tile = base + rows[:, None] * BK + rows_k[None, :]  # [16, BK]
        tile_t = base + rows[None, :] * BK + rows_k[:, None]  # [BK, 16]
        square = (c * HV + i_hv) * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]
        b_qd = tl.load(q_decayed + tile)
        b_w = tl.load(w + tile)
        b_krt = tl.load(k_restored + tile_t)
        b_M = tl.load(M + square)
        b_gamma = tl.load(gamma + (c * HV + i_hv) * BK + rows_k)

        dUt = tl.dot(b_dot.to(tl.float32), b_M, input_precision=DOT_PRECISION)
        dUt += _mm(dSt, b_krt, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        dSt = (
            dSt * b_gamma[None, :]
            + _mm(b_dot, b_qd, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
            - _mm(dUt, b_w, MIXED, operand_dtype, DOT_PRECISION, INTERPRET)
        )

    if STORE_DH0:
        tl.store(dh0 + state_tile, dSt, mask=state_mask)


def state_grad_chain(p, tables, ws: dict[str, torch.Tensor], do: torch.Tensor, dht: torch.Tensor | None,
                     dh0: torch.Tensor | None, dstates: torch.Tensor, mixed: bool, dot_precision: str) -> None:  # fmt: skip
    """Launch the reverse chain over every (V slice, sequence, value head): writes ``dstates``
    ([NC, HV, V, K]: the gradient of the state leaving each chunk) and ``dh0`` (float32, the
    initial state's layout) when given."""
    N, HV = tables.seq_offsets.shape[0] - 1, p.HV
    grid = lambda meta: (cdiv(p.V, meta["BV"]) * N * HV,)  # noqa: E731
    state_grad_chain_kernel[grid](
        do, dht, dh0, dstates,
        ws["q_decayed"], ws["w"], ws["k_restored"], ws["gamma"], ws["M"],
        tables.seq_offsets, tables.chunk_offsets,
        min(next_power_of_2(N * HV), 1024),
        HV, p.K, p.V, BK=tables.BK,
        HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, STATE_V_FIRST=p.state_v_first,
        MIXED=mixed, DOT_PRECISION=dot_precision, INTERPRET=interpreting(),
    )  # fmt: skip
