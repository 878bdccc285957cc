"""The autograd boundary: one ``torch.library.custom_op`` pair for the chunked KDA with
Triton's backward, its fake (shape) functions and its backward registered beside it, so eager
autograd, ``torch.compile`` and AOTAutograd share one code path.

- ``kda::chunk_fwd``: ``(o, final_state, checkpoints)``; the checkpoints are what the backward
  needs (``kda.triton.training``), empty when no backward will run. The forward runs on Triton
  or on the CUDA path (``use_cuda``: K2 writes the same checkpoints). Inference calls that
  torch.compile traces run through it too: the CUDA path's launches through cuda-python are
  opaque to dynamo, which would break the graph there.
- ``kda::chunk_bwd``: the gradients of every differentiable input.

Both take the checked call (:class:`kda.validation.Problem`) flattened into tensors and plain
scalars, which is what an operator schema can carry. ``cu_seqlens_cpu`` rides along as a CPU
tensor: the chunk tables are built on the host from it, without a device sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kda import dispatch, validation
from kda.tables import checkpoint_rows
from kda.validation import Problem


def _problem(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    lower_bound: float | None, output_final_state: bool, use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool,
    allow_neg_eigval: bool, safe_gate: bool, state_v_first: bool, final_state_dtype: torch.dtype,
) -> Problem:  # fmt: skip
    """The :class:`Problem` the operator's arguments came from, checked once already but for the
    offsets' values where torch.compile traced the call (dynamo cannot read them): read and
    checked here, where the operator runs (a sync without a host copy, as an eager call's)."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    values = None
    if cu_seqlens is not None:
        cu_seqlens, cu_seqlens_cpu, values = validation._check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, q.device)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    gate_form = "precomputed" if not use_gate else ("softplus" if lower_bound is None else "lower_bound")
    return Problem(
        "chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate,
        use_beta_sigmoid, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, state_v_first, cu_seqlens,
        cu_seqlens_cpu, values, True, final_state_dtype, B, T, H, K, HV, V, N, gate_form,
    )  # fmt: skip


def _problem_args(p: Problem) -> tuple:
    """The operator's arguments for ``p``, in :func:`_problem`'s order."""
    return (
        p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state, p.cu_seqlens, p.cu_seqlens_cpu, p.scale,
        p.lower_bound, p.output_final_state, p.use_qk_l2norm, p.use_gate, p.use_beta_sigmoid, p.allow_neg_eigval,
        p.safe_gate, p.state_v_first, p.final_state_dtype,
    )  # fmt: skip


PROBLEM_ARGS = 20  # len(_problem_args(p)): the operator's inputs after which its own follow


@torch.library.custom_op("kda::chunk_fwd", mutates_args=())
def chunk_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    lower_bound: float | None, output_final_state: bool, use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool,
    allow_neg_eigval: bool, safe_gate: bool, state_v_first: bool, final_state_dtype: torch.dtype,
    save_checkpoints: bool, use_cuda: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The chunked forward on Triton or on the CUDA path (``use_cuda``, a problem the CUDA
    backend accepted): ``(o, final_state or an empty tensor, checkpoints or an empty tensor)``.
    Either path writes the checkpoints the Triton backward starts from."""
    from kda.triton import chunk_forward
    from kda.triton.training import new_checkpoints, train_forward

    p = _problem(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, lower_bound,
                 output_final_state, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, safe_gate,
                 state_v_first, final_state_dtype)  # fmt: skip
    with dispatch.on_device_of(q):  # Triton launches on the current device, not the tensors'
        why = _cuda_misaligned(p) if use_cuda else None
        if use_cuda and why is None:
            from kda.cuda.forward import chunk_forward as cuda_chunk_forward

            if save_checkpoints:
                checkpoints = new_checkpoints(p)
                o, ht = cuda_chunk_forward(p, checkpoints)
            else:
                (o, ht), checkpoints = cuda_chunk_forward(p), q.new_empty(0, dtype=torch.float32)
        else:
            if use_cuda:  # the address test rejects cannot run under compile (kda.cuda.CudaBackend.rejects)
                dispatch.note(f"cuda refused: {why}; Triton runs it")
            if save_checkpoints:
                o, ht, checkpoints = train_forward(p)
            else:
                (o, ht), checkpoints = chunk_forward(p), q.new_empty(0, dtype=torch.float32)
    _zero_padding(p, o)
    return o, (q.new_empty(0, dtype=final_state_dtype) if ht is None else ht), checkpoints


def _zero_padding(p: Problem, *rows: Tensor) -> None:
    """Zero ``rows`` past the end of a padded buffer (``cu_seqlens`` ending before T) whose
    offsets were read here: a call torch.compile traced runs the buffer whole (an eager call's
    check cuts it to the covered rows) and the kernels never write those rows. Not under a
    CUDA-graph capture, whose replays may cover more rows than this end (validation leaves
    the rows past it undefined there, as fla's use_graph layout does)."""
    end = p.T if p.cu_seqlens_values is None else p.cu_seqlens_values[-1]
    for x in rows if end < p.T and not dispatch.capturing(p.q) else ():
        x[:, end:].zero_()


def _cuda_misaligned(p: Problem) -> str | None:
    from kda.cuda import misaligned

    return misaligned(p)


def _state_shape(q: Tensor, v: Tensor, N: int, state_v_first: bool) -> tuple[int, int, int, int]:
    K, (HV, V) = q.shape[-1], v.shape[-2:]
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


@chunk_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, lower_bound,
      output_final_state, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, safe_gate, state_v_first,
      final_state_dtype, save_checkpoints, use_cuda=False):  # fmt: skip
    B, T = q.shape[:2]
    HV, V = v.shape[-2:]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty(_state_shape(q, v, N, state_v_first) if output_final_state else (0,), dtype=final_state_dtype)
    rows = (checkpoint_rows(B, T, N, cu_seqlens is not None), HV, V, q.shape[-1]) if save_checkpoints else (0,)
    return o, ht, q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("kda::chunk_bwd", mutates_args=())
def chunk_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    lower_bound: float | None, output_final_state: bool, use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool,
    allow_neg_eigval: bool, safe_gate: bool, state_v_first: bool, final_state_dtype: torch.dtype,
    checkpoints: Tensor, do: Tensor, dht: Tensor | None, use_cuda: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` on Triton (after a forward on the CUDA
    path, ``use_cuda``, the reverse chain may run there: kda.triton.training.cuda_chain_refusal);
    an empty tensor for each of the last three whose input is absent."""
    from kda.triton.training import backward

    p = _problem(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, lower_bound,
                 output_final_state, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, safe_gate,
                 state_v_first, final_state_dtype)  # fmt: skip
    dispatch.log_once("chunk_kda backward -> triton")
    dispatch.note("chunk_kda backward -> triton")
    with dispatch.on_device_of(q):  # autograd's device threads set it too; a direct call may not
        grads = backward(p, do, dht, checkpoints, use_cuda)
    _zero_padding(p, *(grads[name] for name in ("q", "k", "v", "g", "beta")))
    return (
        grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"],  # outputs may not alias: one empty each
        *(q.new_empty(0) if grads.get(name) is None else grads[name] for name in ("A_log", "dt_bias", "initial_state")),
    )  # fmt: skip


@chunk_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, *rest):
    def like(x):
        return q.new_empty(0) if x is None else torch.empty_like(x)

    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), like(A_log), like(dt_bias), like(initial_state))  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    tensors = inputs[:10]  # q .. cu_seqlens_cpu
    ctx.save_for_backward(*tensors, output[2])
    ctx.scalars = inputs[10:PROBLEM_ARGS]
    ctx.has_initial_state = inputs[7] is not None
    ctx.use_cuda = bool(inputs[PROBLEM_ARGS + 1])  # (torch passes defaulted arguments too)
    ctx.saved_checkpoints = bool(inputs[PROBLEM_ARGS])
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, _dcheckpoints):
    if not ctx.saved_checkpoints:  # the backward would read the empty tensor (a review of 2026-12-07)
        raise RuntimeError(
            "kda::chunk_fwd was called with save_checkpoints=False: its outputs have no backward "
            "(call it with save_checkpoints=True, as kda.chunk_kda does for inputs that require grad)"
        )
    *tensors, checkpoints = ctx.saved_tensors
    q = tensors[0]
    if do is None:  # only the final state was used
        do = torch.zeros(q.shape[:2] + tensors[2].shape[2:], dtype=q.dtype, device=q.device)
    if dht is not None and dht.numel() == 0:
        dht = None
    dht = None if dht is None else dht.contiguous()
    grads = chunk_bwd(*tensors, *ctx.scalars, checkpoints, do.contiguous(), dht, ctx.use_cuda)
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = grads
    A_log, dt_bias = tensors[5], tensors[6]
    return (
        dq, dk, dv, dg, dbeta,
        None if A_log is None else dA_log,
        None if dt_bias is None else ddt_bias,
        dh0 if ctx.has_initial_state else None,
        *([None] * (PROBLEM_ARGS - 8)), None, None,
    )  # fmt: skip


chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_trainable(p: Problem, use_cuda: bool = False) -> tuple[Tensor, Tensor | None]:
    """Run ``p`` through :func:`chunk_fwd` (the autograd-aware path, and the one torch.compile
    traces): ``(o, final_state or None)``. ``use_cuda``: the forward on the CUDA path (which
    saves the checkpoints when ``p`` requires grad); the backward runs on Triton, its reverse
    chain on the CUDA path after a CUDA forward (kda.triton.training.cuda_chain_refusal)."""
    o, ht, _ = chunk_fwd(*_problem_args(p), p.requires_grad, use_cuda)
    return o, (ht if p.output_final_state else None)
