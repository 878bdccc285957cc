"""The Triton backend's training path: a forward that saves state checkpoints, and the backward.

Memory, on purpose: the forward keeps nothing but its inputs and the float32 state entering
every ``CHECKPOINT_CHUNKS``-th chunk (a quarter of the per-chunk states). The backward
recomputes the prepare stage's operands (token-parallel, cheap), runs the reverse chain of the
state gradient (``state_grad.py``, which stores the gradient of every chunk's leaving state in
the workspace dtype), then every chunk's local gradients (``chunk_grad.py``, which steps the
state forward from its checkpoint). Nothing of the size of the per-chunk states lives beyond
the backward call.
"""

from __future__ import annotations

from functools import partial

import torch

from kda.dispatch import log_once, note
from kda.tables import checkpoint_rows, chunk_tables
from kda.triton import chunk_forward, precision_for
from kda.triton.chunk_grad import input_grad_slices, input_grads, local_products
from kda.triton.common import safe_gate_path
from kda.triton.prepare import prepare_chunks
from kda.triton.state_grad import state_grad_chain
from kda.validation import Problem


def checkpoint_shape(p: Problem) -> tuple[int, int, int, int]:
    """``[rows, HV, V, K]``: the training forward's checkpoints (see common.checkpoint_rows)."""
    return (checkpoint_rows(p.B, p.T, p.N, p.cu_seqlens is not None), p.HV, p.V, p.K)


def new_checkpoints(p: Problem) -> torch.Tensor:
    """The checkpoint tensor of :func:`checkpoint_shape` for a forward to fill. A varlen call's rows
    past the real ones (at most N, as sum_n ceil(L_n / 64) >= ceil(T / 64)) are zeros, not left
    uninitialised: they are never read, but they are an output of ``kda::chunk_fwd``, which
    torch.library.opcheck found differing between two runs (a review of 2026-12-07). The last N
    rows are zeroed before the forward writes the real ones among them: N rows, not the tensor."""
    checkpoints = p.q.new_empty(checkpoint_shape(p), dtype=torch.float32)
    if p.cu_seqlens is not None:
        checkpoints[-min(p.N, checkpoints.shape[0]) :].zero_()
    return checkpoints


def train_forward(p: Problem) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(o, final_state, checkpoints)``: the forward, saving what the backward needs."""
    checkpoints = new_checkpoints(p)
    o, ht = chunk_forward(p, checkpoints=checkpoints)
    return o, ht, checkpoints


def cuda_chain_refusal(
    p: Problem, do: torch.Tensor, dht: torch.Tensor | None, cuda_forward: bool = False
) -> str | None:
    """Why the backward of ``p`` does not run its reverse chain on the CUDA path, or None: it
    does after a forward on the CUDA path (``cuda_forward``) unless ``KDA_CUDA_BACKWARD_CHAIN=0``,
    where the CUDA backend takes ``p`` (bf16, K = V = 128, H = HV) with the safe lower-bound
    gate, a bf16 ``do`` and a float32 or bf16 ``dht``. (A call on ``backend="triton"`` stays on
    Triton forward and backward.)"""
    import kda.cuda

    if not cuda_forward:
        return "the forward ran on Triton"
    if not kda.cuda.BACKWARD_CHAIN:
        return "KDA_CUDA_BACKWARD_CHAIN=0"
    backend = kda.cuda.BACKEND
    why = backend.availability() or backend.rejects(p) or kda.cuda.misaligned(p)
    if why is None and not safe_gate_path(p):
        why = "the gate is not the safe lower-bound gate (the far-row flags come from the Triton prepare stage)"
    if why is None and do.dtype != torch.bfloat16:
        why = f"do is {do.dtype} (the chain reads bf16)"
    if why is None and do.data_ptr() % kda.cuda.ALIGNMENT:  # its rows arrive by 16-byte bulk copies
        why = f"do is not {kda.cuda.ALIGNMENT}-byte aligned"
    if why is None and dht is not None and dht.dtype not in (torch.float32, torch.bfloat16):
        why = f"dht is {dht.dtype} (the chain reads float32 or bf16)"
    if why is not None:
        log_once(f"chunk_kda backward: reverse chain on Triton ({why})")
    return why


def backward(
    p: Problem, do: torch.Tensor, dht: torch.Tensor | None, checkpoints: torch.Tensor, cuda_forward: bool = False
) -> dict[str, torch.Tensor | None]:
    """Gradients of every differentiable input of ``p`` for the output gradient ``do`` and the
    final-state gradient ``dht`` (None: zero): a dict keyed by input name (q, k, v, g, beta,
    A_log, dt_bias, initial_state), each in its input's shape and dtype, or None where the
    input is absent. ``cuda_forward``: the forward ran on the CUDA path, so the reverse chain
    may too (:func:`cuda_chain_refusal`)."""
    workspace_dtype, dot_precision, mixed = precision_for(p.q.dtype)
    tables = chunk_tables(p)
    # dv now, the other input gradients once the per-chunk state gradients are freed (below)
    grads: dict[str, torch.Tensor | None] = {"v": torch.empty_like(p.v)}
    NC, HV = tables.num_chunks, p.HV
    A_log_part = dt_bias_part = None
    if p.A_log is not None:
        A_log_part = p.q.new_zeros(NC, HV, input_grad_slices(p.K, tables.BK), dtype=torch.float32)
        grads["A_log"] = A_log_part
    if p.dt_bias is not None:
        dt_bias_part = p.q.new_zeros(NC, HV, p.K, dtype=torch.float32)
        grads["dt_bias"] = dt_bias_part
    h0 = p.initial_state
    dh0 = None if h0 is None else torch.empty(h0.shape, dtype=torch.float32, device=h0.device)
    if p.N * HV:
        dstates = p.q.new_empty(NC, HV, p.V, p.K, dtype=workspace_dtype)
        k1_layout = cuda_chain_refusal(p, do, dht, cuda_forward) is None
        products = None
        if k1_layout:  # K1 and the CUDA reverse chain, and unless switched off the CUDA state products
            import kda.cuda
            from kda.cuda.training import k1_operands
            from kda.cuda.training import state_grad_chain as cuda_state_grad_chain
            from kda.cuda.training import state_products as cuda_state_products

            do = do.contiguous()  # (the chain and the products read its rows by bulk copies)
            workspace = cuda_state_grad_chain(p, do, dht, dh0, dstates, tables)
            ws = k1_operands(workspace)
            if kda.cuda.STATE_PRODUCTS:
                log_once("chunk_kda backward: K1, the reverse chain and the state products on cuda, the rest on triton")
                products = partial(cuda_state_products, p, do, checkpoints, dstates, workspace, tables)
            else:
                log_once("chunk_kda backward: K1 and the reverse chain on cuda, the rest on triton")
            del workspace  # (held by ws's views and the products' launcher until they go, below)
        else:
            ws = prepare_chunks(p, tables, workspace_dtype, dot_precision)
            note("triton:prepare_chunks")
            state_grad_chain(p, tables, ws, do, dht, dh0, dstates, mixed, dot_precision)
            note("triton:state_grad_chain")
            del ws["q_decayed"]  # (the chain's alone: 256 B a token and value head off the products' peak)
        if NC:
            scratch = local_products(
                p, tables, ws, do, checkpoints, dstates, grads["v"], mixed, dot_precision, k1_layout, products
            )
        # The state products, the last reader of the state gradients and of the workspace but its
        # far-row flags, are queued: both are freed here (in stream order: only work queued after
        # them on this stream gets their blocks), and dq, dk, dg, dbeta are allocated after, so
        # the backward's peak, the products, no longer holds them (13 GB at 2^21 tokens and H8),
        # and the prepare stage backwards (with a cold autotune cache, the tuner's copy of the
        # scratch too) stays below it.
        far = ws.get("far")
        del dstates, products, ws
    grads |= {name: torch.empty_like(getattr(p, name)) for name in ("q", "k", "g", "beta")}
    if p.N * HV and NC:
        input_grads(p, tables, far, scratch, grads, dot_precision)
        note("triton:chunk_grads")
    if A_log_part is not None:
        grads["A_log"] = A_log_part.sum((0, 2))
    if dt_bias_part is not None:
        grads["dt_bias"] = dt_bias_part.sum(0).view(p.dt_bias.shape)
    grads["initial_state"] = None if dh0 is None else dh0.to(h0.dtype)
    return grads
