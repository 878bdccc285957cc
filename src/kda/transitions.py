"""Affine transitions of runs of tokens, from the chunk kernels themselves (spec section 8).

The state after a run of tokens is ``S_after = P S_before + R`` (``reference.segment_transition``
derives P and R chunk by chunk). Any backend's chunked forward gives both without new kernels:
R is the final state of the run from a zero state, and P, which does not depend on v, the
final states of the run with v = 0 from the columns of the identity (a state holds V columns,
so ``ceil(K / V)`` runs). Context parallelism (``context_parallel``) exchanges them between
ranks; the segment split (``segments``) chains them within one GPU.
"""

from __future__ import annotations

import torch

from kda.validation import STATE_DTYPES


def kv_layout(v_first: bool):
    """``(as_kv, from_kv)``: a state in the caller's layout to ``[.., K, V]`` and back."""

    def as_kv(x):
        return x.transpose(-1, -2) if v_first else x

    def from_kv(x):
        return x.transpose(-1, -2).contiguous() if v_first else x.contiguous()

    return as_kv, from_kv


def affine_transitions(chunk_kda, q, k, v, g, beta, kw: dict, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P [N, HV, K, K], R [N, HV, K, V])`` in the full-precision state dtype (float32, or
    float64 for float64 inputs) of each of the N sequences of the call
    ``chunk_kda(q, k, v, g, beta, **kw)`` (``kw`` without initial_state / output_final_state)."""
    K, (HV, V) = q.shape[-1], v.shape[2:]
    dtype = STATE_DTYPES[q.dtype][0]  # the full-precision one: float32, or float64 for float64 inputs
    as_kv, from_kv = kv_layout(bool(kw.get("state_v_first", False)))
    # a caller's bf16 final_state_dtype is for its own final state, not for P and R (it would
    # round every transition to 8 bits)
    kw = dict(kw, final_state_dtype=None)
    zeros = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device)
    # ([1]: the outputs of these runs are not kept, so one is alive at a time)
    R = as_kv(chunk_kda(q, k, v, g, beta, initial_state=from_kv(zeros), output_final_state=True, **kw)[1])
    P = torch.empty(N, HV, K, K, dtype=dtype, device=q.device)
    eye = torch.eye(K, dtype=dtype, device=q.device)
    v0 = torch.zeros_like(v)
    for c0 in range(0, K, V):
        cols = min(V, K - c0)
        start = zeros.clone()
        start[..., :cols] = eye[:, c0 : c0 + cols]
        out = chunk_kda(q, k, v0, g, beta, initial_state=from_kv(start), output_final_state=True, **kw)[1]
        P[..., c0 : c0 + cols] = as_kv(out)[..., :cols]
    return P, R
