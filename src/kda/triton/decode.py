"""Decode in one launch (spec section 7): the token loop over a few tokens per sequence, each
sequence's state read once and written once; through a state pool in place, or from
``initial_state`` to a new final state.

One program per (V slice, sequence, value head) keeps the slice ``S^T [BV, K]`` in float32
registers and runs ``reference.pooled_recurrent_kda``'s loop over the sequence's tokens:
``S = S Diag(exp(g_t))``, ``u = beta_t (v_t - S^T k_t)``, ``S += k_t u^T``, ``o_t = scale S^T q_t``,
with the gate, beta sigmoid and l2norm applied in the kernel as the flags say.

Slots: ``INDICES`` 0 (none: sequence n is slot n; a plain call's states are a pool of N
slots), 1 (``indices [N]``: read and write ``indices[n]``) or 2 (``indices [N, S]``: read
``indices[n, accepted[n] - 1]`` (column 0 without ``accepted``), write the state after token t
to ``indices[n, t]``). An index outside ``[0, P)`` is no slot: nothing read (zeros), nothing
written, so no index can reach memory outside the pool. The kernel reads indices and
``cu_seqlens`` on the device, clamped into the call's tokens (validation checks the lengths on
the host: see ``validation.CHECK_CU_SEQLENS``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.intmath import cdiv, next_power_of_2
from kda.triton.prepare import L2NORM_EPS, _gate

# Launch shapes (see decode_launch): the state slice [BV, K] of a program sits in float32 registers.
DECODE_BV = 32  # V columns of a program in a small grid, on DECODE_WARPS warps
DECODE_WARPS = 4
DECODE_BV_STREAMING = 16  # V columns of a one-warp program in a grid of many
DECODE_MANY_PROGRAMS = 1024  # programs (at DECODE_BV columns) from which the one-warp shape wins
# Cache hints on the state's one read and one write (evict-first load, streaming store). Off:
# slower at every launch shape measured (H200, 2026-12-01, run 15, fp32, N=32: 16 x 1 0.0432 ms,
# with the hints 0.0511; N=256: 0.2832 / 0.3514; benchmarks/NOTES.md, decode).
DECODE_STREAM = False


@triton.jit
def _in_pool(slot, tile, state_mask, P):
    """The state tile's mask for ``slot``: empty unless ``0 <= slot < P`` (the slot broadcast
    to the tile first: the interpreter takes no scalar-and-block masks)."""
    at = slot + tl.zeros_like(tile)
    return state_mask & (at >= 0) & (at < P)


@triton.jit
def decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, indices, accepted, seq_offsets,
    scale, lower_bound, beta_scale,
    P, T, H, HV, K, V, S_COLS,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    INDICES: tl.constexpr, HAS_ACCEPTED: tl.constexpr,
    STREAM: tl.constexpr,  # states read and written once: evict-first loads, streaming stores
    IN_PLACE: tl.constexpr,  # h0 and ht are one pool
):  # fmt: skip
    # One grid dimension (V slices fastest): a second one would stop at 65535 sequence-heads.
    pid = tl.program_id(0).to(tl.int64)
    slices_v = tl.cdiv(V, BV)
    i_v, i_nh = pid % slices_v, pid // slices_v
    n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:  # clamped into [0, T] (unchecked offsets that decrease make sequences overlap:
        # their outputs then race, but no access leaves the tensors)
        bos = tl.minimum(tl.maximum(tl.load(seq_offsets + n), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(seq_offsets + n + 1), bos), T)
        if INDICES == 2:  # and no token past the row of indices (unchecked lengths)
            eos = tl.minimum(eos, bos + S_COLS)
    else:  # B sequences of T tokens: no offsets table, nothing built on the host
        bos = n * T
        eos = bos + T
    rows_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    k_ok = rows_k < K
    v_ok = cols_v < V
    state_mask = v_ok[:, None] & k_ok[None, :]
    if STATE_V_FIRST:  # [P, HV, V, K]
        tile = i_hv * K * V + cols_v[:, None] * K + rows_k[None, :]
    else:  # [P, HV, K, V]
        tile = i_hv * K * V + rows_k[None, :] * V + cols_v[:, None]
    slot_size = HV * K * V

    if INDICES == 0:
        first = n
    elif INDICES == 1:
        first = tl.load(indices + n).to(tl.int64)
    else:
        col = 0
        if HAS_ACCEPTED:  # clamped into the row: accepted outside [1, S] reads no other row
            col = tl.minimum(tl.maximum(tl.load(accepted + n).to(tl.int64) - 1, 0), S_COLS - 1)
        first = tl.load(indices + n * S_COLS + col).to(tl.int64)
    first_mask = _in_pool(first, tile, state_mask, P)
    St = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_H0:
        if STREAM:
            St += tl.load(h0 + first * slot_size + tile, mask=first_mask, other=0.0,
                          eviction_policy="evict_first").to(tl.float32)  # fmt: skip
        else:
            St += tl.load(h0 + first * slot_size + tile, mask=first_mask, other=0.0).to(tl.float32)

    a = 1.0
    if GATE != 0 and HAS_A_LOG:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.zeros([BK], dtype=tl.float32)
    if GATE != 0 and HAS_DT_BIAS:
        bias = tl.load(dt_bias + i_hv * K + rows_k, mask=k_ok, other=0.0).to(tl.float32)
    for t in tl.range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + rows_k, mask=k_ok, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + rows_k, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + L2NORM_EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + L2NORM_EPS)
        b_g = tl.load(g + (t * HV + i_hv) * K + rows_k, mask=k_ok, other=0.0).to(tl.float32)
        if GATE != 0:
            b_g = tl.where(k_ok, _gate(b_g + bias, a, lower_bound, GATE), 0.0)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if BETA_SIGMOID:
            b_beta = beta_scale * tl.sigmoid(b_beta)
        b_v = tl.load(v + (t * HV + i_hv) * V + cols_v, mask=v_ok, other=0.0).to(tl.float32)
        St = St * tl.exp(b_g)[None, :]
        u = b_beta * (b_v - tl.sum(St * b_k[None, :], axis=1))
        St = St + u[:, None] * b_k[None, :]
        b_o = tl.sum(St * b_q[None, :], axis=1) * scale
        tl.store(o + (t * HV + i_hv) * V + cols_v, b_o.to(o.dtype.element_ty), mask=v_ok)
        if INDICES == 2:
            to = tl.load(indices + n * S_COLS + (t - bos)).to(tl.int64)
            to_mask = _in_pool(to, tile, state_mask, P)
            tl.store(ht + to * slot_size + tile, St.to(ht.dtype.element_ty), mask=to_mask)
    if STORE_HT and INDICES != 2:
        if IN_PLACE:  # a pool slot of a sequence with no tokens keeps its state: not written back,
            # so a slot shared with a sequence that has tokens is that sequence's alone
            first_mask = first_mask & ((bos + tl.zeros_like(tile)) < eos)
        if STREAM:
            tl.store(ht + first * slot_size + tile, St.to(ht.dtype.element_ty), mask=first_mask, cache_modifier=".cs")
        else:
            tl.store(ht + first * slot_size + tile, St.to(ht.dtype.element_ty), mask=first_mask)


def decode_launch(p) -> tuple[int, int]:
    """(V columns per program, warps) for ``p``, as measured on an H200 (2026-12-01, H=32,
    K=V=128; benchmarks/NOTES.md, decode): in a grid of many programs (N >= 32) one-warp
    programs of 16 columns stream plain calls' states fastest (float32, N=256: 0.279 ms
    against 0.303 at 32 columns and 4 warps) and bfloat16 pools' (0.207 / 0.247); float32
    pools, whose programs first load their slot index, keep 32 x 4 (0.318 / 0.347). A
    small grid (N=1) takes 32 x 4 (8.3 us; 1 warp: 9.3)."""
    many = p.N * p.HV * cdiv(p.V, DECODE_BV) >= DECODE_MANY_PROGRAMS
    if many and not (p.pool is not None and p.pool.dtype == torch.float32):
        return min(DECODE_BV_STREAMING, next_power_of_2(p.V)), 1
    return min(DECODE_BV, next_power_of_2(p.V)), DECODE_WARPS


def decode(
    p, block_v: int | None = None, num_warps: int | None = None, stream: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``p`` (a checked call: a pool's, or a plain one with few tokens per sequence) in one
    launch: ``(o, final state)``. A pool is updated in place and returned; a plain call's
    final state is a new tensor (or None without ``output_final_state``). Nothing is built
    on the host: batched calls need no offsets, varlen ones read ``cu_seqlens`` on the device.
    ``block_v``, ``num_warps``, ``stream`` (cache hints): override the launch (benchmarks
    compare them)."""
    o = torch.empty(p.B, p.T, p.HV, p.V, dtype=p.q.dtype, device=p.q.device)
    if p.pool is not None:
        h0 = ht = p.pool
    else:
        h0 = p.initial_state
        ht = torch.empty(p.state_shape, dtype=p.final_state_dtype, device=p.q.device) if p.output_final_state else None
    if p.N * p.HV == 0 or p.T == 0:
        if ht is not None and p.pool is None:  # no tokens: the final state is the initial one
            ht.copy_(h0) if h0 is not None else ht.zero_()
        return o, ht
    idx = p.state_indices
    mode = 0 if idx is None else idx.dim()
    gate = {"precomputed": 0, "lower_bound": 1, "softplus": 2}[p.gate_form]
    BV, warps = decode_launch(p)
    BV, warps = block_v or BV, num_warps or warps
    decode_kernel[(cdiv(p.V, BV) * p.N * p.HV,)](
        p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, o, h0, ht, idx, p.accepted, p.cu_seqlens,
        p.scale, p.lower_bound if p.lower_bound is not None else 0.0, 2.0 if p.allow_neg_eigval else 1.0,
        p.N if p.pool is None else p.pool.shape[0], p.T, p.H, p.HV, p.K, p.V, idx.shape[1] if mode == 2 else 1,
        BK=next_power_of_2(p.K), BV=BV,
        GATE=gate, HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
        L2NORM=p.use_qk_l2norm, BETA_SIGMOID=p.use_beta_sigmoid, STATE_V_FIRST=p.state_v_first,
        VARLEN=p.cu_seqlens is not None, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        INDICES=mode, HAS_ACCEPTED=p.accepted is not None, STREAM=DECODE_STREAM if stream is None else stream,
        IN_PLACE=p.pool is not None,
        num_warps=warps,
    )  # fmt: skip
    return o, ht


SCATTER_BLOCK = 1024  # state values a program copies


@triton.jit
def scatter_states_kernel(states, pool, indices, P, SLOT: tl.constexpr, BLOCK: tl.constexpr):
    """``pool[indices[n]] = states[n]`` where ``0 <= indices[n] < P``; nothing elsewhere."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(indices + n).to(tl.int64) + tl.zeros_like(offs).to(tl.int64)
    mask = (offs < SLOT) & (slot >= 0) & (slot < P)
    x = tl.load(states + n * SLOT + offs, mask=mask)
    tl.store(pool + slot * SLOT + offs, x.to(pool.dtype.element_ty), mask=mask)
