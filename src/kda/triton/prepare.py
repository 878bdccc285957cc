"""Stage 1 of the chunk-16 forward: prepare, token-parallel, one program per (chunk, value head).

For its 16 rows the program activates the inputs (gate, l2norm, beta sigmoid), takes the
chunk-local cumulative log-decay G, and writes what the recurrence needs (``kda-spec.md``
section 2; ``reference.prepare_chunk`` is the same computation in torch):

- ``q_decayed = scale * q * exp(G)``, ``w = (I+A)^-1 Diag(beta) K~`` and
  ``k_restored = k * exp(G_last - G)``, each ``[16, K]`` in the workspace dtype;
- ``inverse_beta = (I+A)^-1 Diag(beta)`` and ``M``, each ``[16, 16]`` in float32 (the
  inverse loses bits in bf16, and these are 1/8 of the bytes);
- ``gamma = exp(G_last)`` ``[K]`` in float32.

What is not stored, by bytes moved: v stays in the caller's tensor and the recurrence forms
``inverse_beta @ v`` itself (a 16x16 by 16xBV product off the serial path). Storing
``U0 = inverse_beta @ v`` instead would write and re-read 16xV values per chunk to save
reading 1 KB, and round U0 to bf16 on the way.

Exponents: A and M need ``exp(G_i - G_j)`` for ``j <= i``. The fast path factors it as
``(k_i exp(G_i)) . (k_j exp(-G_j))``, anchored at the chunk start (a fixed offset, so a row
never depends on later rows, not even through rounding). ``exp(-G_j)`` is clamped at
``2^EXP2_LIMIT``; a row whose decay passes that limit is recomputed from the pairwise
differences directly. The lower-bound gate with ``lb >= -5`` never passes it
(``16 * 5 / ln 2 < 116``), so that path is compiled out there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda import abi
from kda.reference import GATE_FLOOR as _GATE_FLOOR
from kda.reference import HARD_RESET as _HARD_RESET
from kda.tables import CHUNK
from kda.triton.common import autotune_configs, safe_gate_path

ROWS = tl.constexpr(CHUNK)
LOG2E = tl.constexpr(1.4426950408889634)
EXP2_LIMIT = tl.constexpr(abi.EXP2_LIMIT)  # 2^116 * |k| stays far below the float32 maximum 2^128
L2NORM_EPS = tl.constexpr(abi.L2NORM_EPS)
HARD_RESET = tl.constexpr(_HARD_RESET)  # a log-decay below it zeroes its channel (reference.HARD_RESET)
GATE_FLOOR = tl.constexpr(_GATE_FLOOR)  # the softplus gate's floor (reference.GATE_FLOOR)
# The launches of a kernel with a pairwise path where the gate can pass the factored form's range
# (not SAFE): the first (PAIRWISE False) runs every program without that path and flags the ones
# whose chunk needs it; the second runs only those, with it, and overwrites all they wrote. With
# the rare path in every program, ptxas gave prepare_chunks_kernel 248 registers at 4 warps (168
# without it, 143 for the safe gate) and chunk_grad's input-gradient kernel 64 registers and 7.9 KB
# of spill code at 8 warps (255 and 0.4 KB without it); sm_90, Triton 3.6, 2026-12-01, NOTES.md.
FAR_LAUNCHES = (False, True)


@triton.jit
def _softplus(x):
    # log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _row(x, rows, i):
    """Row ``i`` of ``x`` as a vector, exactly (adds only zeros)."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), axis=0)


@triton.jit
def pair_decay(G2, R, rows, j):
    """``exp(G_i - G_j)`` of every row i against row j (every exponent <= 0; rows i < j give
    1 and are masked by the caller), 0 where a hard reset lies between them."""
    d_ij = tl.exp2(tl.minimum(G2 - _row(G2, rows, j)[None, :], 0.0))
    return tl.where(_row(R, rows, j)[None, :] == R, d_ij, 0.0)


@triton.jit
def _gate(x, a, lower_bound, GATE: tl.constexpr):
    """The in-kernel gate of ``x = g_raw + dt_bias`` with ``a = exp(A_log)`` (1 without A_log):
    ``lb * sigmoid(a x)`` (GATE 1) or ``-a softplus(x)`` (GATE 2)."""
    if GATE == 1:
        return lower_bound * tl.sigmoid(a * x)
    # The floor keeps the gate finite (no 0 * inf in the gradients); a NaN gate stays NaN, as in the
    # reference (tl.maximum's default drops NaN: a NaN gate became a silent hard reset until
    # 2026-12-07, tests/test_nan.py).
    return tl.maximum(-a * _softplus(x), GATE_FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def load_rows(x, tok, row_ok, cols, col_ok, i_h, H, K):
    """Rows ``tok`` of head i_h of a [.., H, K] tensor, columns ``cols`` (all of K or a slice),
    in float32; 0 outside the masks."""
    ptrs = x + (tok[:, None] * H + i_h) * K + cols[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def load_qk(q, k, tok, row_ok, cols, col_ok, i_h, H, K, L2NORM: tl.constexpr):
    """One chunk's rows ``tok`` of q and k (head i_h) in float32, L2-normalised when asked:
    ``(q, k, q_rstd, k_rstd)``, the rstd (1 without L2NORM) for the backward."""
    b_q = load_rows(q, tok, row_ok, cols, col_ok, i_h, H, K)
    b_k = load_rows(k, tok, row_ok, cols, col_ok, i_h, H, K)
    q_rstd = tl.full([ROWS], 1.0, tl.float32)
    k_rstd = tl.full([ROWS], 1.0, tl.float32)
    if L2NORM:
        q_rstd = tl.rsqrt(tl.sum(b_q * b_q, axis=1) + L2NORM_EPS)
        k_rstd = tl.rsqrt(tl.sum(b_k * b_k, axis=1) + L2NORM_EPS)
        b_q *= q_rstd[:, None]
        b_k *= k_rstd[:, None]
    return b_q, b_k, q_rstd, k_rstd


@triton.jit
def load_gate_beta(
    g, beta, A_log, dt_bias, tok, row_ok, cols, col_ok, i_hv, HV, K, lower_bound, beta_scale,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):  # fmt: skip
    """One chunk's rows of g and beta (value head i_hv), activated as the flags say, float32.
    Rows past the sequence end (``~row_ok``) read as g = 0, beta = 0: they add no decay and
    write nothing. Returns ``(g, beta, x, a, beta_raw)``: the activations' inputs ride along
    for the backward (``x = g_raw + dt_bias``, ``a = exp(A_log)``, 1 without it)."""
    mask = row_ok[:, None] & col_ok[None, :]
    b_g = tl.load(g + (tok[:, None] * HV + i_hv) * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b_raw = tl.load(beta + tok * HV + i_hv, mask=row_ok, other=0.0).to(tl.float32)
    x = b_g
    a = 1.0
    if GATE != 0:
        if HAS_DT_BIAS:
            x += tl.load(dt_bias + i_hv * K + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_A_LOG:
            a = tl.exp(tl.load(A_log + i_hv))
        b_g = tl.where(mask, _gate(x, a, lower_bound, GATE), 0.0)
    b_beta = b_raw
    if BETA_SIGMOID:
        b_beta = tl.where(row_ok, beta_scale * tl.sigmoid(b_raw), 0.0)
    return b_g, b_beta, x, a, b_raw


@triton.jit
def chunk_decays(b_g, rows, SAFE: tl.constexpr):
    """The chunk's decays from its log-decays ``b_g`` [16, columns], column by column (so a
    slice of the K columns gives that slice's): ``(G2, R, decay, to_end, whole)`` as
    :func:`chunk_operands` returns them."""
    if SAFE:  # the lower-bound gate: g >= lb >= -5, never a reset
        G2 = tl.cumsum(b_g, axis=0) * LOG2E  # masked rows repeat the last valid row
        R = tl.zeros(b_g.shape, dtype=tl.float32)
    else:
        reset = b_g < HARD_RESET
        G2 = tl.cumsum(tl.where(reset, 0.0, b_g), axis=0) * LOG2E
        R = tl.cumsum(reset.to(tl.float32), axis=0)
    G2_last = _row(G2, rows, ROWS - 1)
    R_last = _row(R, rows, ROWS - 1)
    decay = tl.where(R > 0, 0.0, tl.exp2(G2))
    to_end = tl.where(R_last[None, :] == R, tl.exp2(G2_last[None, :] - G2), 0.0)  # exponent <= 0
    whole = tl.where(R_last > 0, 0.0, tl.exp2(G2_last))
    return G2, R, decay, to_end, whole


@triton.jit
def unit_lower_inverse(b_A, rows):
    """``(I + A)^-1`` of a strictly lower [16, 16] ``A``, float32:
    ``(I - A)(I + A^2)(I + A^4)(I + A^8)``, since A^16 = 0."""
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    A2 = tl.dot(b_A, b_A, input_precision="ieee")
    A4 = tl.dot(A2, A2, input_precision="ieee")
    A8 = tl.dot(A4, A4, input_precision="ieee")
    inv = tl.dot(eye - b_A, eye + A2, input_precision="ieee")
    inv = tl.dot(inv, eye + A4, input_precision="ieee")
    return tl.dot(inv, eye + A8, input_precision="ieee")


@triton.jit
def chunk_operands(
    b_q, b_k, b_g, b_beta, scale, rows, SAFE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIRWISE: tl.constexpr
):
    """Everything of one chunk that does not depend on the state (spec section 2), float32:
    ``(G2, R, decay, to_end, whole, Q~, K~, K^, Kinv, A_unit, M, T, inverse_beta, w, any_far)``
    with G2 the cumulative log-decay in base 2 without the hard-reset steps (g < HARD_RESET,
    ``reference.chunk_decays``), R the resets up to each row, ``decay = exp(G)``, ``to_end =
    exp(G_last - G)`` and ``whole = exp(G_last)`` (each 0 across a reset), ``Kinv = k exp(-G)``
    (clamped at 2^EXP2_LIMIT), ``A_unit`` the strictly lower A without beta, ``T = (I + A)^-1``
    and ``any_far`` whether some row passed the limit or a reset. Such rows take the pairwise
    recompute where ``PAIRWISE`` compiles it in; without it (a launch that leaves those chunks to
    another, ``FAR_LAUNCHES``) their operands are wrong and the caller must not use
    them."""
    G2, R, decay, to_end, whole = chunk_decays(b_g, rows, SAFE)
    b_qd = b_q * decay * scale  # Q~
    b_kd = b_k * decay  # K~
    b_kr = b_k * to_end  # K^
    b_kinv = b_k * tl.exp2(tl.minimum(-G2, EXP2_LIMIT))  # k exp(-G), exact on rows within the limit

    b_A = tl.dot(b_kd, tl.trans(b_kinv), input_precision=DOT_PRECISION)
    b_M = tl.dot(b_qd, tl.trans(b_kinv), input_precision=DOT_PRECISION)
    any_far = False
    if not SAFE:
        # Row i only needs columns j <= i, whose -G_j <= -G_i: a row within the limit is exact.
        # A row past a reset pairs with the columns after it, which the factored form cannot
        # tell from the ones before: it takes the pairwise path too.
        row_far = (tl.min(G2, axis=1) < -EXP2_LIMIT) | (tl.max(R, axis=1) > 0)
        any_far = tl.max(row_far.to(tl.int32), axis=0) > 0
        if PAIRWISE:  # noqa: SIM102 (a constexpr and a tensor: no `and` between them in Triton)
            if any_far:
                A_pair = tl.zeros([ROWS, ROWS], dtype=tl.float32)
                M_pair = tl.zeros([ROWS, ROWS], dtype=tl.float32)
                for j in tl.static_range(ROWS):
                    k_j = _row(b_k, rows, j)
                    d_ij = pair_decay(G2, R, rows, j)
                    a_col = tl.sum(b_k * (k_j[None, :] * d_ij), axis=1)
                    m_col = tl.sum(b_q * (k_j[None, :] * d_ij), axis=1) * scale
                    A_pair = tl.where(rows[None, :] == j, a_col[:, None], A_pair)
                    M_pair = tl.where(rows[None, :] == j, m_col[:, None], M_pair)
                b_A = tl.where(row_far[:, None], A_pair, b_A)
                b_M = tl.where(row_far[:, None], M_pair, b_M)

    b_Au = tl.where(rows[:, None] > rows[None, :], b_A, 0.0)
    b_M = tl.where(rows[:, None] >= rows[None, :], b_M, 0.0)
    b_A = b_Au * b_beta[:, None]

    inv = unit_lower_inverse(b_A, rows)
    b_ib = inv * b_beta[None, :]  # (I + A)^-1 Diag(beta)
    b_w = tl.dot(b_ib, b_kd, input_precision=DOT_PRECISION)
    return G2, R, decay, to_end, whole, b_qd, b_kd, b_kr, b_kinv, b_Au, b_M, inv, b_ib, b_w, any_far


@triton.jit
def chunk_position(chunk_seq, seq_offsets, chunk_offsets, i_c):
    """``(sequence, its first token, its end, its first chunk, the chunk's first token)``."""
    n = tl.load(chunk_seq + i_c).to(tl.int64)
    bos = tl.load(seq_offsets + n)
    eos = tl.load(seq_offsets + n + 1)
    c_first = tl.load(chunk_offsets + n)
    return n, bos, eos, c_first, bos + (i_c - c_first) * ROWS


@triton.autotune(configs=autotune_configs([{}], warps=(2, 4, 8), stages=(1,)), key=["BK", "GATE", "SAFE", "PAIRWISE"])
@triton.jit
def prepare_chunks_kernel(
    q, k, g, beta, A_log, dt_bias,
    seq_offsets, chunk_offsets, chunk_seq,
    q_decayed, w, k_restored, gamma, inverse_beta, M, far,
    scale, lower_bound, beta_scale,
    H, HV, K,  # runtime: one compiled kernel serves every head count and head size up to BK
    BK: tl.constexpr,
    GATE: tl.constexpr,  # 0: g is the log-decay; 1: lower-bound gate; 2: softplus gate
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    SAFE: tl.constexpr,  # the gate provably stays inside EXP2_LIMIT: no fallback path
    DOT_PRECISION: tl.constexpr,
    PAIRWISE: tl.constexpr,  # without SAFE: the second of FAR_LAUNCHES, for the chunks the first flagged
):  # fmt: skip
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, _, eos, _, t0 = chunk_position(chunk_seq, seq_offsets, chunk_offsets, i_c)
    if t0 >= eos:  # a slot past the real chunks (kda.tables): nothing reads its workspace
        return
    if PAIRWISE:  # noqa: SIM102 (a constexpr and a tensor: no `and` between them in Triton)
        if tl.load(far + i_c * HV + i_hv) == 0:
            return

    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BK)
    tok = t0 + rows
    row_ok = tok < eos
    col_ok = cols < K
    b_q, b_k, _, _ = load_qk(q, k, tok, row_ok, cols, col_ok, i_h, H, K, L2NORM)
    b_g, b_beta, _, _, _ = load_gate_beta(
        g, beta, A_log, dt_bias, tok, row_ok, cols, col_ok, i_hv, HV, K, lower_bound, beta_scale,
        GATE, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID,
    )  # fmt: skip
    _, _, _, _, whole, b_qd, _, b_kr, _, _, b_M, _, b_ib, b_w, any_far = chunk_operands(
        b_q, b_k, b_g, b_beta, scale, rows, SAFE, DOT_PRECISION, PAIRWISE
    )
    if not SAFE and not PAIRWISE:  # this chunk's operands are wrong if any_far: the second launch rewrites them
        tl.store(far + i_c * HV + i_hv, any_far.to(tl.int8))

    # Workspace: [NC, HV, 16, BK] operands, [NC, HV, 16, 16] matrices, [NC, HV, BK] gamma.
    tile = (i_c * HV + i_hv) * ROWS * BK + rows[:, None] * BK + cols[None, :]
    tl.store(q_decayed + tile, b_qd.to(q_decayed.dtype.element_ty))
    tl.store(w + tile, b_w.to(w.dtype.element_ty))
    tl.store(k_restored + tile, b_kr.to(k_restored.dtype.element_ty))
    square = (i_c * HV + i_hv) * ROWS * ROWS + rows[:, None] * ROWS + rows[None, :]
    tl.store(inverse_beta + square, b_ib)
    tl.store(M + square, b_M)
    tl.store(gamma + (i_c * HV + i_hv) * BK + cols, whole)


def prepare_chunks(p, tables, workspace_dtype: torch.dtype, dot_precision: str) -> dict[str, torch.Tensor]:
    """Launch the prepare stage for every chunk of ``p`` (a checked :class:`Problem`): the
    workspace by name and, for the gates that are not safe, ``far`` ([NC, HV] int8: the chunk
    and value head took the pairwise path, ``FAR_LAUNCHES``)."""
    NC, HV, BK = tables.num_chunks, p.HV, tables.BK
    dev = p.q.device
    ws = {
        "q_decayed": torch.empty(NC, HV, CHUNK, BK, dtype=workspace_dtype, device=dev),
        "w": torch.empty(NC, HV, CHUNK, BK, dtype=workspace_dtype, device=dev),
        "k_restored": torch.empty(NC, HV, CHUNK, BK, dtype=workspace_dtype, device=dev),
        "inverse_beta": torch.empty(NC, HV, CHUNK, CHUNK, dtype=torch.float32, device=dev),
        "M": torch.empty(NC, HV, CHUNK, CHUNK, dtype=torch.float32, device=dev),
        "gamma": torch.empty(NC, HV, BK, dtype=torch.float32, device=dev),
    }
    safe = safe_gate_path(p)
    far = None  # the safe gate's kernels have no pairwise path, so no flags
    if not safe:  # written by the first launch; the backward's input-gradient kernel reads them too
        ws["far"] = far = torch.empty(NC, HV, dtype=torch.int8, device=dev)
    if NC == 0:
        return ws
    gate = {"precomputed": 0, "lower_bound": 1, "softplus": 2}[p.gate_form]
    for pairwise in (False,) if safe else FAR_LAUNCHES:
        prepare_chunks_kernel[(NC, HV)](
            p.q, p.k, p.g, p.beta, p.A_log, p.dt_bias,
            tables.seq_offsets, tables.chunk_offsets, tables.chunk_seq,
            ws["q_decayed"], ws["w"], ws["k_restored"], ws["gamma"], ws["inverse_beta"], ws["M"], far,
            p.scale, p.lower_bound if p.lower_bound is not None else 0.0, 2.0 if p.allow_neg_eigval else 1.0,
            p.H, HV, p.K, BK=BK,
            GATE=gate, HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
            L2NORM=p.use_qk_l2norm, BETA_SIGMOID=p.use_beta_sigmoid,
            SAFE=safe, DOT_PRECISION=dot_precision, PAIRWISE=pairwise,
        )  # fmt: skip
    return ws
