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


def affine_transitions(chunk_kda, q, k, v, g, beta, kw: dict, N: int, outputs: bool = False, runs=None) -> tuple:
    """``(P [N, HV, K, K], R [N, HV, K, V])`` in the full-precision state dtype (float32, or
    float64 for float64 inputs) of each of the N sequences of the call
    ``chunk_kda(q, k, v, g, beta, **kw)`` (``kw`` without initial_state / output_final_state).
    Both may be strided views of the runs' final states (R, and P where K <= V: the first K
    columns of one run's, which it keeps alive); nothing here writes into them.

    ``outputs``: also the runs' outputs, ``(P, R, o_zero [.., T, HV, V], o_P [.., T, HV, K])``: the
    call's output from zero states, and ``o_P`` with ``o_zero + o_P S`` the output from states S
    (row t of a sequence: ``scale Phi_t^T q_t``, Phi_t its transition up to token t, which is
    what the runs from the identity's columns with v = 0 output), both in the inputs' dtype.

    ``runs``: where given, ``runs(q, k, g, beta, [(v, initial_state), ...], kw)`` gives the
    ``(o, final state)`` of every run (v None: zeros; initial_state None, the first run's: a
    zero state), as a list or an iterable that runs them as
    they are taken (kda.api.chunk_kda_runs: on the CUDA path K1, which neither v nor the state
    enters, serves them all at once, K = V: two runs, both outputs kept); else chunk_kda runs them
    one at a time. Without ``outputs`` each run's output is dropped once used."""
    K, (HV, V) = q.shape[-1], v.shape[2:]
    dtype = STATE_DTYPES[q.dtype][0]  # the full-precision one: float32, or float64 for float64 inputs
    v_first = bool(kw.get("state_v_first", False))
    as_kv, _ = kv_layout(v_first)
    # a caller's bf16 final_state_dtype is for its own final state, not for P and R (it would
    # round every transition to 8 bits)
    kw = dict(kw, final_state_dtype=None)
    blocks = [(c0, min(V, K - c0)) for c0 in range(0, K, V)]  # P's columns, V at a time

    def identity_columns(c0: int, cols: int) -> torch.Tensor:
        """The identity's columns c0 .. c0 + cols as a state in the call's layout, zeros beside,
        written in place through a [K, V] view: the transposed copies of a [K, V] build (four a
        split call, with its zeros' clone) took 0.2 ms of the 2M H8 call on an H100 (2026-12-05,
        run 160, benchmarks/long_profile.py)."""
        start = torch.zeros(N, HV, *((V, K) if v_first else (K, V)), dtype=dtype, device=q.device)
        torch.diagonal(as_kv(start)[..., c0 : c0 + cols, :cols], dim1=-2, dim2=-1).fill_(1)
        return start

    def starts(v0):  # (v, initial state) of each run; v0 the P runs' v = 0
        yield v, None  # R: the run from a zero state, which no initial state is
        for c0, cols in blocks:
            yield v0, identity_columns(c0, cols)

    if runs is not None:  # (None: zeros the runs need not make)
        results = iter(runs(q, k, g, beta, list(starts(None)), kw))
    else:
        results = (
            chunk_kda(q, k, v_run, g, beta, initial_state=h0, output_final_state=True, **kw)
            for v_run, h0 in starts(torch.zeros_like(v))
        )
    o_zero, R = next(results)
    R = as_kv(R)
    if not outputs:
        o_zero = None
    # K <= V: one P run, whose final state's first K columns are P (a view, no copy)
    P = None if len(blocks) == 1 else torch.empty(N, HV, K, K, dtype=dtype, device=q.device)
    o_P = None
    for (c0, cols), (o, out) in zip(blocks, results):
        if P is None:
            P = as_kv(out)[..., :cols].to(dtype)
        else:
            P[..., c0 : c0 + cols] = as_kv(out)[..., :cols]
        if outputs and len(blocks) == 1 and cols == V:  # K = V: the run's output is o_P (no copy)
            o_P = o
        elif outputs:
            if o_P is None:
                o_P = torch.empty(*v.shape[:-1], K, dtype=v.dtype, device=q.device)
            o_P[..., c0 : c0 + cols] = o[..., :cols]
        del o
    return (P, R, o_zero, o_P) if outputs else (P, R)
