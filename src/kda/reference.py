"""Kimi Delta Attention in plain torch: the specification, step by step.

Everything here runs on any device and in any floating dtype, float64 included, and is the
yardstick the kernels are measured against. Two forms of the same function:

- :func:`naive_recurrent_kda`: the token-by-token recurrence (``kda-spec.md`` section 1);
- :func:`chunk16_kda`: the chunk-16 form (section 2), cut into the stages the kernels have:
  :func:`prepare_chunk` (token-parallel: cumsum, decayed operands, A, M, the inverse) and
  :func:`recurrence_step` (sequential over chunks: the state update).

Shapes follow fla: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``;
beta ``[B, T, HV]``; states ``[N, HV, K, V]`` (KV layout). The functions here take the
*activated* gate and beta; :func:`activate_inputs` applies the optional pre-processing
(l2norm, gate activation, beta sigmoid) that the public API fuses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kda.abi import CHUNK, HARD_RESET, L2NORM_EPS  # shared with the kernels (one source)

# ----------------------------------------------------------------------------- helpers


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate_lower_bound(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
) -> torch.Tensor:
    """The safe gate: ``lb * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))``, in ``[lb, 0)``.

    ``g_raw`` is ``[..., HV, K]``; ``A_log`` is ``[HV]`` (None drops the ``exp(A_log)``
    factor); ``dt_bias`` is ``[HV, K]`` or None.
    """
    x = _finite(g_raw if dt_bias is None else g_raw + dt_bias.to(g_raw.dtype))
    if A_log is not None:
        x = A_log.to(g_raw.dtype).exp().unsqueeze(-1) * x
    return lower_bound * torch.sigmoid(x)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with +-inf replaced by the dtype's largest finite value, NaN kept. Both gates saturate
    there to the values they take at +-inf (exp(A_log) times it may overflow to inf again, after
    which nothing is multiplied by it), but their derivative is exactly 0 there, and autograd formed
    dA_log as 0 * inf = NaN from one overflowed activation (a review of 2026-12-07)."""
    return torch.where(x.isinf(), x.sign() * torch.finfo(x.dtype).max, x)


# The softplus gate's output is held at or above this: a hard reset either way (far below
# HARD_RESET), but finite, so that its gradients (dA_log = sum dg g) never form 0 * inf.
GATE_FLOOR = -1e30


def gate_softplus(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """The unbounded gate: ``-exp(A_log[h]) * softplus(g_raw + dt_bias[h])``, in
    ``[GATE_FLOOR, 0]``."""
    x = _finite(g_raw if dt_bias is None else g_raw + dt_bias.to(g_raw.dtype))
    return (-A_log.to(g_raw.dtype).exp().unsqueeze(-1) * F.softplus(x)).clamp(min=GATE_FLOOR)


def beta_from_logits(b: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(b)``, or ``2 * sigmoid(b)`` so that the delta rule may flip a direction."""
    return torch.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)


def activate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
    use_gate: bool = False,
    use_beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The optional pre-processing of the public API, each step switched by its flag."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if use_gate:
        if lower_bound is not None:
            g = gate_lower_bound(g, A_log, dt_bias, lower_bound)
        else:
            g = gate_softplus(g, A_log, dt_bias)
    if use_beta_sigmoid:
        beta = beta_from_logits(beta, allow_neg_eigval)
    return q, k, g, beta


def sequence_bounds(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """``(batch row, start, end)`` of every sequence: B rows of T, or the cu_seqlens segments."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]


def _expand_qk_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """GVA: value head j reads q/k head j // (HV // H)."""
    return x.repeat_interleave(HV // x.shape[-2], dim=-2)


# ----------------------------------------------------------------------------- recurrence


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token-by-token recurrence, in the dtype of ``q`` (spec section 1).

    Per token: ``S = Diag(exp(g_t)) S``; ``S += beta_t k_t (v_t - S^T k_t)^T``;
    ``o_t = scale * S^T q_t``. States are KV layout ``[N, HV, K, V]``.
    """
    return _each_sequence(_token_steps, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def _token_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence: inputs ``[L, HV, ...]``, state ``[HV, K, V]``."""
    o = torch.zeros_like(v)
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)
        residual = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", beta[t].unsqueeze(-1) * k[t], residual)
        o[t] = scale * torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def _each_sequence(
    advance, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared frame of both forms: GVA head expansion, dtypes, sequences one by one.
    ``advance(q, k, v, g, beta, S, scale)`` runs one sequence (inputs ``[L, HV, ...]``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    o = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    bounds = sequence_bounds(T, B, cu_seqlens)
    final = torch.zeros(len(bounds), HV, K, V, dtype=dtype, device=q.device)
    for n, (b, start, end) in enumerate(bounds):
        S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        if initial_state is not None:
            S = initial_state[n].to(dtype).clone()
        o[b, start:end], final[n] = advance(*(x[b, start:end] for x in (q, k, v, g, beta)), S, scale)
    return o, (final if output_final_state else None)


def pooled_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    pool: torch.Tensor,
    indices: torch.Tensor | None,
    accepted: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token loop through a state pool (spec section 7), in place: ``pool [P, HV, K, V]``.

    ``indices`` None: sequence n starts from and ends in slot n. 1-D ``[N]``: from and to
    ``pool[indices[n]]``. 2-D ``[N, S]``: from ``pool[indices[n, accepted[n] - 1]]``
    (``indices[n, 0]`` without ``accepted``; accepted clamped into ``[1, S]``), and the
    state after its t-th token goes to ``pool[indices[n, t]]``. An index outside ``[0, P)``
    is no slot: the sequence starts from zeros, nothing is written. Returns o; the pool is updated in place."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    P, dtype = pool.shape[0], q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    o = torch.zeros(B, T, HV, V, dtype=dtype, device=q.device)
    idx = None if indices is None else indices.cpu().tolist()
    nat = None if accepted is None else accepted.cpu().tolist()

    def slot(i: int) -> int | None:
        return i if 0 <= i < P else None

    for n, (b, start, end) in enumerate(sequence_bounds(T, B, cu_seqlens)):
        if idx is None:
            first = slot(n)
        elif isinstance(idx[n], list):
            # accepted outside [1, S] is clamped into the row (as the kernels do)
            first = slot(idx[n][min(max(nat[n] - 1, 0), len(idx[n]) - 1) if nat is not None else 0])
        else:
            first = slot(idx[n])
        S = torch.zeros(HV, K, V, dtype=dtype, device=q.device) if first is None else pool[first].to(dtype).clone()
        for t in range(start, end):
            o[b, t : t + 1], S = _token_steps(*(x[b, t : t + 1] for x in (q, k, v, g, beta)), S, scale)
            if idx is not None and isinstance(idx[n], list) and (to := slot(idx[n][t - start])) is not None:
                pool[to] = S.to(pool.dtype)
        if idx is None or not isinstance(idx[n], list):
            to = slot(n) if idx is None else slot(idx[n])
            if to is not None:
                pool[to] = S.to(pool.dtype)
    return o


# ----------------------------------------------------------------------------- chunk-16 form


@dataclass
class ChunkOperands:
    """What the prepare stage hands the recurrence for one chunk of C <= 16 rows.

    Shapes per value head (leading ``[HV]`` dimension omitted): ``q_decayed``, ``w`` and
    ``k_restored`` ``[C, K]``; ``inverse_beta`` and ``M`` ``[C, C]``; ``gamma`` ``[K]``.
    """

    q_decayed: torch.Tensor  # Q~ = scale * q * exp(G)
    w: torch.Tensor  # (I + A)^-1 Diag(beta) K~, so that U = (I+A)^-1 Diag(beta) V - w S
    inverse_beta: torch.Tensor  # (I + A)^-1 Diag(beta)
    M: torch.Tensor  # scale * q_i . (k_j * exp(G_i - G_j)), j <= i
    k_restored: torch.Tensor  # K^ = k * exp(G_last - G)
    gamma: torch.Tensor  # exp(G_last): the decay of the whole chunk


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A`` of size <= 16, as a finite product.

    ``A^16 = 0``, so ``(I + A)^-1 = sum_n (-A)^n = (I - A)(I + A^2)(I + A^4)(I + A^8)``:
    three squarings and three products, all dense (tensor-core friendly in a kernel).
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    A2 = A @ A
    A4 = A2 @ A2
    A8 = A4 @ A4
    return (eye - A) @ (eye + A2) @ (eye + A4) @ (eye + A8)


# HARD_RESET (kda.abi): a log-decay below it is a hard reset of its key channel: exp(-104) =
# 6.8e-46 is under half of float32's smallest subnormal, so float32 rounds every decay through
# such a step to 0, exactly as for g = -inf (spec section 9). The cumulative sums skip these
# steps and count them instead, so that no -inf - (-inf), no 0 * inf and no difference of two
# huge sums (g = -1e30) is ever formed: a decay across a reset is 0, one within a stretch
# between resets is the exponential of a finite sum.


@dataclass
class ChunkDecays:
    """A chunk's decays, reset-aware: ``G`` the cumulative log-decay without the reset steps,
    ``R`` how many resets up to each row (``[..., C, K]`` both), and the exponentials the
    chunk form needs: ``pair`` ``exp(G_i - G_j)`` for ``j <= i`` ``[..., C, C, K]``, ``from_start``
    ``exp(G_i)`` (since the chunk start), ``to_end`` ``exp(G_last - G_i)``, ``whole``
    ``exp(G_last)`` ``[..., K]``; each 0 where a reset lies in between."""

    G: torch.Tensor
    R: torch.Tensor
    reset: torch.Tensor
    pair: torch.Tensor
    from_start: torch.Tensor
    to_end: torch.Tensor
    whole: torch.Tensor


def chunk_decays(g: torch.Tensor) -> ChunkDecays:
    """:class:`ChunkDecays` of ``g [..., C, K]`` (one chunk's log-decays).

    The pairwise decays are formed from the differences directly, so every exponent is <= 0:
    exact for any gate, the unbounded softplus one included. (The kernels factor them as two
    decayed operands where the range allows; see ``docs/algorithm.md``.)"""
    C = g.shape[-2]
    reset = g < HARD_RESET  # NaN compares False: a NaN gate stays NaN
    G = g.masked_fill(reset, 0.0).cumsum(-2)
    R = reset.to(g.dtype).cumsum(-2)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., i, j, K] = G_i - G_j
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril().unsqueeze(-1)
    within = causal & (R.unsqueeze(-2) == R.unsqueeze(-3))
    pair = diff.masked_fill(~within, float("-inf")).exp()
    G_last, R_last = G[..., -1:, :], R[..., -1:, :]
    return ChunkDecays(
        G=G,
        R=R,
        reset=reset,
        pair=pair,
        from_start=G.masked_fill(R > 0, float("-inf")).exp(),
        to_end=(G_last - G).masked_fill(R_last != R, float("-inf")).exp(),
        whole=G_last.masked_fill(R_last > 0, float("-inf")).exp().squeeze(-2),
    )


def prepare_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> ChunkOperands:
    """The token-parallel stage for one chunk: ``q, k, g [HV, C, K]``, ``beta [HV, C]``."""
    C = q.shape[-2]
    e = chunk_decays(g)  # G_i = g_1 + ... + g_i, resets apart
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = torch.einsum("hid,hjd,hijd->hij", k, k, e.pair) * beta.unsqueeze(-1)
    A = A.masked_fill(~strict, 0.0)
    M = scale * torch.einsum("hid,hjd,hijd->hij", q, k, e.pair)
    inverse_beta = unit_lower_inverse(A) * beta.unsqueeze(-2)  # (I+A)^-1 Diag(beta)
    k_decayed = k * e.from_start  # K~
    return ChunkOperands(
        q_decayed=scale * q * e.from_start,
        w=inverse_beta @ k_decayed,
        inverse_beta=inverse_beta,
        M=M,
        k_restored=k * e.to_end,
        gamma=e.whole,
    )


def recurrence_step(ops: ChunkOperands, v: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the sequential stage: ``v [HV, C, V]``, ``S [HV, K, V]`` -> ``(O, S_next)``.

    ``U = (I+A)^-1 Diag(beta) (V - K~ S) = inverse_beta V - w S`` (the new values);
    ``O = Q~ S + M U``; ``S_next = Diag(gamma) S + K^^T U``.
    """
    U = ops.inverse_beta @ v - ops.w @ S
    O = ops.q_decayed @ S + ops.M @ U
    S_next = ops.gamma.unsqueeze(-1) * S + ops.k_restored.transpose(-1, -2) @ U
    return O, S_next


def chunk16_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    pairs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk-16 form (spec section 2), in the dtype of ``q``; same contract as
    :func:`naive_recurrent_kda`. Each sequence is cut into chunks from its own start;
    the last chunk may be shorter. ``pairs``: the sequential stage two chunks a step
    (:func:`pair_step`; an odd last chunk alone, by :func:`recurrence_step`)."""
    advance = functools.partial(_chunk_steps, chunks=2 if pairs else 1)
    return _each_sequence(advance, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def step_operands(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float, chunks: int = 1):
    """``(rows, [ChunkOperands of each chunk in rows])`` for each sequential step of ``chunks``
    chunks over one sequence (inputs ``[L, HV, ...]``, cut into chunks of 16 from its start; the
    last step may hold fewer chunks, its last chunk fewer rows)."""
    L = q.shape[0]
    for c0 in range(0, L, chunks * CHUNK):
        cuts = [min(c0 + i * CHUNK, L) for i in range(chunks + 1)]
        ops = [
            prepare_chunk(*(x[r0:r1].transpose(0, 1) for x in (q, k, g, beta)), scale)
            for r0, r1 in zip(cuts, cuts[1:])
            if r1 > r0
        ]
        yield slice(c0, cuts[-1]), ops


def _chunk_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    scale: float,
    chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare chunk by chunk, the recurrence ``chunks`` (1 or 2) chunks a step over one
    sequence (inputs ``[L, HV, ...]``; a pair by :func:`pair_step`, a lone chunk by
    :func:`recurrence_step`)."""
    o = torch.zeros_like(v)
    for rows, ops in step_operands(q, k, g, beta, scale, chunks):
        v_c = v[rows].transpose(0, 1)
        O, S = pair_step(pair_operands(*ops), v_c, S) if len(ops) == 2 else recurrence_step(ops[0], v_c, S)
        o[rows] = O.transpose(0, 1)
    return o, S


# ----------------------------------------------------------------------------- pairs of chunks


@dataclass
class PairOperands:
    """Two consecutive chunks a, b as one sequential step (``docs/algorithm.md`` section 2b): the
    chunk-16 operands rescaled to the pair's start and end, plus the coupling of b's writes to a's.

    Shapes per value head, ``R = C_a + C_b`` rows: ``q_decayed``, ``w``, ``k_restored`` ``[R, K]``;
    ``inverse_beta`` and ``M`` ``[R, R]``; ``coupling`` ``[C_b, C_a]``; ``gamma`` ``[K]``.
    """

    q_decayed: torch.Tensor  # [Q~_a; Q~_b Diag(gamma_a)]: decayed from the pair's start
    w: torch.Tensor  # [w_a; w_b Diag(gamma_a)]
    inverse_beta: torch.Tensor  # Diag(inverse_beta_a, inverse_beta_b), block-diagonal
    coupling: torch.Tensor  # D = w_b K^_a^T: how a's writes enter b's
    M: torch.Tensor  # [[M_a, 0], [Q~_b K^_a^T, M_b]]
    k_restored: torch.Tensor  # [K^_a Diag(gamma_b); K^_b]: decayed to the pair's end
    gamma: torch.Tensor  # gamma_a gamma_b


def pair_operands(a: ChunkOperands, b: ChunkOperands) -> PairOperands:
    """:class:`PairOperands` of chunk ``a`` and the chunk ``b`` after it, from their chunk-16
    operands alone (nothing of v or the state): every new factor is a product of decays <= 1
    and every exponential stays the chunk-16 stage's, so the pair keeps its exponent ranges."""
    Ca, Cb = a.w.shape[-2], b.w.shape[-2]
    ga, gb = a.gamma.unsqueeze(-2), b.gamma.unsqueeze(-2)
    zeros = a.M.new_zeros(*a.M.shape[:-2], Ca, Cb)
    ib = torch.cat(
        [torch.cat([a.inverse_beta, zeros], -1), torch.cat([zeros.transpose(-1, -2), b.inverse_beta], -1)], -2
    )
    cross = b.q_decayed @ a.k_restored.transpose(-1, -2)
    return PairOperands(
        q_decayed=torch.cat([a.q_decayed, b.q_decayed * ga], -2),
        w=torch.cat([a.w, b.w * ga], -2),
        inverse_beta=ib,
        coupling=b.w @ a.k_restored.transpose(-1, -2),
        M=torch.cat([torch.cat([a.M, zeros], -1), torch.cat([cross, b.M], -1)], -2),
        k_restored=torch.cat([a.k_restored * gb, b.k_restored], -2),
        gamma=a.gamma * b.gamma,
    )


def pair_step(ops: PairOperands, v: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunks of the sequential stage in one: ``v [HV, R, V]``, ``S [HV, K, V]`` -> ``(O, S_next)``.

    ``X = inverse_beta V - w S`` is both chunks' ``U`` as if each entered with ``S`` decayed to
    its start; b's writes also see a's, ``U_b = X_b - D U_a`` (the coupling is strictly block
    lower, so its inverse is ``I - L``). Then ``O = Q~ S + M U`` and ``S_next = Diag(gamma) S +
    K^^T U`` as in :func:`recurrence_step`: one state product ``w S`` for two chunks."""
    Ca = ops.q_decayed.shape[-2] - ops.coupling.shape[-2]
    X = ops.inverse_beta @ v - ops.w @ S
    U = torch.cat([X[..., :Ca, :], X[..., Ca:, :] - ops.coupling @ X[..., :Ca, :]], -2)
    O = ops.q_decayed @ S + ops.M @ U
    S_next = ops.gamma.unsqueeze(-1) * S + ops.k_restored.transpose(-1, -2) @ U
    return O, S_next


# ----------------------------------------------------------------------------- segments (spec section 8)


def chunk_transition(ops: ChunkOperands, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's step as an affine map of the state: ``S_next = A S + b`` with
    ``A = Diag(gamma) - K^^T w [HV, K, K]`` and ``b = K^^T inverse_beta V [HV, K, V]``
    (:func:`recurrence_step` with ``U = inverse_beta V - w S`` substituted)."""
    k_t = ops.k_restored.transpose(-1, -2)
    A = torch.diag_embed(ops.gamma) - k_t @ ops.w
    return A, k_t @ (ops.inverse_beta @ v)


def segment_transition(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P [HV, K, K], R [HV, K, V])`` of a run of chunks (inputs ``[L, HV, ...]``, cut into
    chunks of 16 from its start): the state after it is ``P S + R`` for the state S before it.
    ``P = A_m ... A_1`` and ``R = sum_i A_m ... A_{i+1} b_i``, built chunk by chunk."""
    HV, K = q.shape[1], q.shape[2]
    P = torch.eye(K, dtype=q.dtype, device=q.device).expand(HV, K, K).clone()
    R = torch.zeros(HV, K, v.shape[-1], dtype=q.dtype, device=q.device)
    for rows, (ops,) in step_operands(q, k, g, beta, scale):
        A, b = chunk_transition(ops, v[rows].transpose(0, 1))
        P, R = A @ P, A @ R + b
    return P, R


def segmented_chunk16_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    segment_chunks: int = 4,
    two_pass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk-16 form with each sequence cut into segments of ``segment_chunks`` chunks
    (spec section 8), :func:`chunk16_kda`'s contract. Three passes: every segment's ``(P, R)``
    (independent of the others: the parallel part), the boundary states chained through them
    (``S_{j+1} = P_j S_j + R_j``, one short sequential scan), and every segment run from its
    true initial state (parallel again).

    ``two_pass``: as the CUDA path's split computes it (``docs/algorithm.md`` section 7b), all
    segments of a sequence at once: one chunk loop over a segment's length, every segment a
    batch entry, whose state carries the zero state's run on v beside the identity's columns on
    v = 0, so that it ends as ``[R | P]`` and its outputs are ``[o_zero | o_P]``; then the
    boundary chain, and ``o = o_zero + o_P S`` with each segment's entering state S. A last
    segment shorter than the others is padded with tokens that leave the state as it is (k = q
    = v = 0, beta = 0, g = 0). On a GPU in float64 it is the yardstick of a million-token call
    (``benchmarks/long_accuracy.py``): the chunk steps run once per segment length, not once per
    chunk of the sequence."""
    if segment_chunks < 1:
        raise ValueError(f"`segment_chunks` must be >= 1, got {segment_chunks}")
    span = segment_chunks * CHUNK
    form = _two_pass_segments if two_pass else _three_pass_segments

    def advance(q, k, v, g, beta, S, scale):
        return form((q, k, v, g, beta), S, scale, span)

    return _each_sequence(advance, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def _three_pass_segments(inputs: tuple, S: torch.Tensor, scale: float, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence (q, k, v, g, beta ``[L, HV, ...]``) in segments of ``span`` tokens, one at a time."""
    q, k, v, g, beta = inputs
    starts = list(range(0, q.shape[0], span))
    pieces = [tuple(x[a : a + span] for x in (q, k, v, g, beta)) for a in starts]
    transitions = [segment_transition(*piece, scale) for piece in pieces]  # parallel over segments
    entering = [S]
    for P, R in transitions[:-1]:  # the scan over segment boundaries
        entering.append(P @ entering[-1] + R)
    o = torch.zeros_like(v)
    for a, piece, S_j in zip(starts, pieces, entering):  # parallel over segments
        o[a : a + span], _ = _chunk_steps(*piece, S_j, scale)
    if transitions:
        P, R = transitions[-1]
        S = P @ entering[-1] + R
    return o, S


def _two_pass_segments(inputs: tuple, S: torch.Tensor, scale: float, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence (q, k, v, g, beta ``[L, HV, ...]``) in segments of ``span`` tokens, all at once."""
    q, k, v, g, beta = inputs
    L, HV, K = q.shape
    V = v.shape[-1]
    if L == 0:
        return torch.zeros_like(v), S
    n = -(-L // span)

    def segments(x: torch.Tensor) -> torch.Tensor:  # [L, HV, ...] -> [n, span, HV, ...], zero-padded
        if n * span == L and x.is_contiguous():  # (a view: a million tokens in float64 are GBs)
            return x.view(n, span, *x.shape[1:])
        padded = x.new_zeros(n * span, *x.shape[1:])
        padded[:L] = x
        return padded.view(n, span, *x.shape[1:])

    qs, ks, vs, gs, bs = (segments(x) for x in (q, k, v, g, beta))
    state = torch.zeros(n, HV, K, V + K, dtype=q.dtype, device=q.device)
    state[..., V:] = torch.eye(K, dtype=q.dtype, device=q.device)
    state = state.view(n * HV, K, V + K)
    outputs = torch.empty(n, span, HV, V + K, dtype=q.dtype, device=q.device)
    zeros = q.new_zeros(n * HV, CHUNK, K)
    for c0 in range(0, span, CHUNK):
        rows = slice(c0, c0 + CHUNK)

        def batch(x: torch.Tensor) -> torch.Tensor:  # [n, C, HV, ...] -> [n HV, C, ...]
            x = x[:, rows].transpose(1, 2)
            return x.reshape(n * HV, *x.shape[2:])

        ops = prepare_chunk(batch(qs), batch(ks), batch(gs), batch(bs), scale)
        O, state = recurrence_step(ops, torch.cat([batch(vs), zeros], -1), state)
        outputs[:, rows] = O.view(n, HV, CHUNK, V + K).transpose(1, 2)
    state = state.view(n, HV, K, V + K)
    R, P = state[..., :V], state[..., V:]
    entering = [S]
    for j in range(n - 1):  # the chain over segment boundaries
        entering.append(P[j] @ entering[-1] + R[j])
    E = torch.stack(entering)  # [n, HV, K, V]
    o = outputs[..., :V] + torch.einsum("nthk,nhkv->nthv", outputs[..., V:], E)
    return o.reshape(n * span, HV, V)[:L], P[-1] @ E[-1] + R[-1]


# ----------------------------------------------------------------------------- chunk-16 backward


@dataclass
class ChunkGrads:
    """Gradients of one chunk's loss with respect to its :class:`ChunkOperands` (and v),
    what :func:`recurrence_step_backward` hands :func:`prepare_chunk_backward`."""

    q_decayed: torch.Tensor  # [C, K]
    w: torch.Tensor  # [C, K]
    inverse_beta: torch.Tensor  # [C, C]
    M: torch.Tensor  # [C, C], lower incl. the diagonal (M's structure)
    k_restored: torch.Tensor  # [C, K]
    gamma: torch.Tensor  # [K]
    v: torch.Tensor  # [C, V]


def recurrence_step_backward(
    ops: ChunkOperands, v: torch.Tensor, S: torch.Tensor, dO: torch.Tensor, dS_next: torch.Tensor
) -> tuple[torch.Tensor, ChunkGrads]:
    """The reverse of :func:`recurrence_step`: given the state ``S`` that entered the chunk,
    ``dO [HV, C, V]`` and the gradient ``dS_next`` of the state that left it, return the
    gradient of the entering state and of the chunk's operands.

    ``dU = M^T dO + K^ dS_next`` (U feeds O and S_next);
    ``dS = Q~^T dO + Diag(gamma) dS_next - w^T dU`` (the reverse state chain: needs no S);
    the operand gradients are the outer products of each forward product's other factor.
    """
    U = ops.inverse_beta @ v - ops.w @ S
    dU = ops.M.transpose(-1, -2) @ dO + ops.k_restored @ dS_next
    dS = ops.q_decayed.transpose(-1, -2) @ dO + ops.gamma.unsqueeze(-1) * dS_next - ops.w.transpose(-1, -2) @ dU
    C = v.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    grads = ChunkGrads(
        q_decayed=dO @ S.transpose(-1, -2),
        w=-dU @ S.transpose(-1, -2),
        inverse_beta=dU @ v.transpose(-1, -2),
        M=(dO @ U.transpose(-1, -2)).masked_fill(~causal, 0.0),
        k_restored=U @ dS_next.transpose(-1, -2),
        gamma=(S * dS_next).sum(-1),
        v=ops.inverse_beta.transpose(-1, -2) @ dU,
    )
    return dS, grads


def prepare_chunk_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    d: ChunkGrads,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse of :func:`prepare_chunk` (same inputs): ``(dq, dk, dg, dbeta)`` from the
    operand gradients ``d``, by the chain rule through each line of the forward.

    ``inverse_beta = T Diag(beta)`` with ``T = (I + A)^-1``, ``dA = -T^T dT T^T``;
    ``A = Diag(beta) (K~ Kinv^T)`` and ``M = Q~ Kinv^T`` restricted to their triangles, with
    ``Kinv = k exp(-G)``, written here through :func:`chunk_decays` so that no exponent is
    positive; ``G = cumsum(g)``, so dg is the reverse cumulative sum of dG (plus the terms of
    ``G_last``, which every row's g enters).
    """
    C = q.shape[-2]
    e = chunk_decays(g)
    decay = e.pair  # [HV, i, j, K] = exp(G_i - G_j), j <= i
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A_unit = torch.einsum("hid,hjd,hijd->hij", k, k, decay).masked_fill(~strict, 0.0)  # A without beta
    T = unit_lower_inverse(A_unit * beta.unsqueeze(-1))
    inverse_beta = T * beta.unsqueeze(-2)
    eG, eG_last = e.from_start, e.whole.unsqueeze(-2)
    k_decayed = k * eG
    k_restored = k * e.to_end
    q_decayed = scale * q * eG

    # w = inverse_beta K~
    d_inverse_beta = d.inverse_beta + d.w @ k_decayed.transpose(-1, -2)
    d_k_decayed = inverse_beta.transpose(-1, -2) @ d.w
    # inverse_beta = T Diag(beta)
    dbeta = (T * d_inverse_beta).sum(-2)
    dT = d_inverse_beta * beta.unsqueeze(-2)
    Tt = T.transpose(-1, -2)
    dA = (-(Tt @ dT @ Tt)).masked_fill(~strict, 0.0)
    # A = Diag(beta) A_unit
    dbeta = dbeta + (dA * A_unit).sum(-1)
    dA_unit = dA * beta.unsqueeze(-1)
    # M's diagonal (decay exp(0)) goes to q and k alone: no exponent to differentiate
    dM_diag = scale * torch.diagonal(d.M, dim1=-2, dim2=-1).unsqueeze(-1)
    dM = d.M.masked_fill(~strict, 0.0)

    # A_unit_ij = sum_d k_id k_jd e_ijd and M_ij = scale sum_d q_id k_jd e_ijd (e = decay, j < i):
    # row i, column j and the exponent G_i - G_j each get their share.
    pair_k = torch.einsum("hij,hjd,hijd->hid", dA_unit, k, decay)  # through k_i (row)
    pair_q = scale * torch.einsum("hij,hjd,hijd->hid", dM, k, decay)  # through q_i
    col = torch.einsum("hij,hid,hijd->hjd", dA_unit, k, decay) + scale * torch.einsum(
        "hij,hid,hijd->hjd", dM, q, decay
    )  # through k_j (column)
    dG_pair = k * pair_k + q * pair_q  # d/dG_i of every pair (i, j); d/dG_j is its negative
    dG_pair_col = k * col

    dq = scale * eG * d.q_decayed + pair_q + dM_diag * k
    dk = eG * d_k_decayed + pair_k + col + e.to_end * d.k_restored + dM_diag * q
    dG = d.q_decayed * q_decayed + d_k_decayed * k_decayed + dG_pair - dG_pair_col
    # dg_t sums dG_i over rows i >= t; K^_i's exponent G_last - G_i is the sum of the g_t with
    # t > i (a sum over the rows before t), gamma's exponent G_last the sum of every row's g
    P = d.k_restored * k_restored
    dg = dG.flip(-2).cumsum(-2).flip(-2) + (P.cumsum(-2) - P) + (d.gamma * eG_last.squeeze(-2)).unsqueeze(-2)
    # a reset step's decay is 0 for every g below HARD_RESET: no gradient
    return dq, dk, dg.masked_fill(e.reset, 0.0), dbeta


def chunk16_kda_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The gradients of :func:`chunk16_kda` by the chunk-form backward, stage by stage as the
    Triton kernels run it: the states entering every chunk (forward), the reverse chain of
    the state gradient, then each chunk's local gradients. Activated inputs, as
    :func:`chunk16_kda`; ``dht`` is the gradient of the final state (None: zero).
    Returns ``(dq, dk, dv, dg, dbeta, dh0)`` with the inputs' shapes (dq, dk summed over the
    value heads that share a q/k head)."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    scale = K**-0.5 if scale is None else scale
    qe, ke = _expand_qk_heads(q, HV), _expand_qk_heads(k, HV)
    dq, dk = torch.zeros_like(qe), torch.zeros_like(ke)
    dv, dg, dbeta = torch.zeros_like(v), torch.zeros_like(g), torch.zeros_like(beta)
    bounds = sequence_bounds(T, B, cu_seqlens)
    dh0 = torch.zeros(len(bounds), HV, K, V, dtype=q.dtype, device=q.device)
    for n, (b, start, end) in enumerate(bounds):
        S = torch.zeros(HV, K, V, dtype=q.dtype, device=q.device)
        if initial_state is not None:
            S = initial_state[n].to(q.dtype)
        chunks = []
        for c0 in range(start, end, CHUNK):
            rows = slice(c0, min(c0 + CHUNK, end))
            q_c, k_c, v_c, g_c, beta_c = (x[b, rows].transpose(0, 1) for x in (qe, ke, v, g, beta))
            ops = prepare_chunk(q_c, k_c, g_c, beta_c, scale)
            chunks.append((rows, ops, S, q_c, k_c, v_c, g_c, beta_c))
            S = recurrence_step(ops, v_c, S)[1]
        dS = torch.zeros_like(S) if dht is None else dht[n].to(q.dtype)
        for rows, ops, S_in, q_c, k_c, v_c, g_c, beta_c in reversed(chunks):
            dS_next = dS
            dS, grads = recurrence_step_backward(ops, v_c, S_in, do[b, rows].transpose(0, 1).to(q.dtype), dS_next)
            dq_c, dk_c, dg_c, dbeta_c = prepare_chunk_backward(q_c, k_c, g_c, beta_c, scale, grads)
            dq[b, rows], dk[b, rows] = dq_c.transpose(0, 1), dk_c.transpose(0, 1)
            dv[b, rows], dg[b, rows], dbeta[b, rows] = grads.v.transpose(0, 1), dg_c.transpose(0, 1), dbeta_c.T
        dh0[n] = dS
    group = HV // H
    dq = dq.view(B, T, H, group, K).sum(3)
    dk = dk.view(B, T, H, group, K).sum(3)
    return dq, dk, dv, dg, dbeta, dh0


# relative_rms takes its float64 sums over slices of this many elements: a whole float64 copy of
# a 2M-token H8 output is 16 GiB, and `kda bench --long`'s split check, which held three of them
# at once, ran out of memory on an 80 GB H100 (run 147, 2026-12-05).
RMS_SLICE = 1 << 24


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (summed over slices of RMS_SLICE elements, so that
    memory stays bounded on any size); NaN anywhere gives NaN (never a pass). ``ref`` may
    broadcast to x's shape, never x to ref's: a one-element x scored as exact against any
    reference it matched one value of (a review of the bench, 2026-12-07)."""
    if torch.broadcast_shapes(x.shape, ref.shape) != x.shape:
        raise ValueError(f"relative_rms of a {list(x.shape)} tensor against a {list(ref.shape)} reference")
    x, ref = torch.broadcast_tensors(x, ref)
    x, ref = x.reshape(-1), ref.reshape(-1)
    err2 = torch.zeros((), dtype=torch.float64, device=ref.device)
    ref2 = torch.zeros((), dtype=torch.float64, device=ref.device)
    for a in range(0, ref.numel(), RMS_SLICE):
        x64, ref64 = x[a : a + RMS_SLICE].double(), ref[a : a + RMS_SLICE].double()
        err2 += (x64 - ref64).square().sum()
        ref2 += ref64.square().sum()
    denom = ref2.sqrt().item()
    err = err2.sqrt().item()
    if denom == 0.0:
        return err if math.isfinite(err) else float("nan")
    return err / denom
