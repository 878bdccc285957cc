"""kda as a backend of flash-linear-attention's dispatcher (``fla.backends``, fla >= 0.6).

After :func:`register_fla_backend`, code that calls fla's KDA (``fla.ops.kda.chunk_kda``, so
fla's own KDA layer and the Hugging Face Kimi Linear modeling code) runs kda unchanged:

    import kda
    kda.register_fla_backend()

fla asks each registered backend, best priority first, whether it takes a call (a verifier
returning ``(accepted, reason)``), logs its choice as ``[FLA Backend] <entry point> -> kda``
(or ``... -> kda rejected: <reason>``, once per reason), and runs its own implementation when
no backend takes the call. ``FLA_KDA=0`` turns kda off (read by fla at each call).

What kda takes:

- ``fla.ops.kda.chunk_kda``: every call kda's own checks accept (training calls too: their
  gradients come from kda's backward: Triton's kernels, and after a CUDA forward with the safe
  gate K1 and the CUDA reverse chain), except calls on a GPU that kda could only run
  on its torch reference (fla's kernels are faster there) and fla's features kda does not have
  (``return_intermediate_states``, a zigzag ``cp_context``): those fall through to fla. A
  contiguous ``cp_context`` runs kda's context parallelism.
- fla's decode entry point ``fused_recurrent_kda_fwd`` (operation ``kda``, what serving
  engines call): every call kda's checks accept, state pools included (``inplace_final_state``
  with ``ssm_state_indices`` and ``num_accepted_tokens``: kda's decode kernels, 0.53-0.90 of
  fla's time on an H200, benchmarks/results/h200-2026-12-02-decode-run27.md), and CPU tensors, where
  fla's Triton kernel cannot run. ``out=``, and GPU calls kda could only run on its torch
  reference, fall through to fla.

Importing kda never imports fla; this module imports it when :func:`register_fla_backend`
runs.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import warnings

BACKEND_TYPE = "kda"
ENV_VAR = "FLA_KDA"
PRIORITY = 2  # fla: lower runs first; FlashKDA's backend is 3
_registered = False
_lock = threading.Lock()
# fla runs a backend's verifier, then at once its implementation on the same arguments. The
# verifier checks the call as kda would, which copies a GPU `cu_seqlens` to the host (a sync);
# it leaves that copy here, per thread, for the implementation, so that a varlen call through fla
# syncs once, as a kda call without `cu_seqlens_cpu` does, not twice (a review, 2026-12-04).
_handoff = threading.local()


def _keep_host_offsets(cu_seqlens, problem) -> None:
    """Keep ``problem``'s host copy of ``cu_seqlens`` (the tensor the call was given, which the
    check may have converted) for the implementation's call."""
    host = problem.cu_seqlens_cpu
    _handoff.kept = None if cu_seqlens is None or host is None else (cu_seqlens, cu_seqlens._version, host)


def _host_offsets(cu_seqlens) -> object:
    """The host copy the verifier kept, if it was of this very ``cu_seqlens`` tensor, unchanged
    since (its version counter), else None; either way it is used once."""
    kept, _handoff.kept = getattr(_handoff, "kept", None), None
    if kept is None or kept[0] is not cu_seqlens or cu_seqlens._version != kept[1]:
        return None
    return kept[2]


def _fold_layout_alias(kwargs: dict, warn: bool) -> dict:
    """``kwargs`` with fla's deprecated ``transpose_state_layout`` passed as ``state_v_first``
    (both given: unchanged, for kda's check to refuse). kda's chunk_kda warns at its caller,
    which here is this module, and the verifier's check warned again: so both fold it, and the
    implementation alone warns, at the first frame outside kda, fla and torch (fla's dispatcher
    runs under torch.compiler.disable): the user's call."""
    if "transpose_state_layout" not in kwargs or "state_v_first" in kwargs:
        return kwargs
    if warn:
        import fla
        import torch

        from kda import validation

        ours = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["kda"], fla, torch))
        frame, level = sys._getframe(), 1
        while frame.f_back is not None and frame.f_code.co_filename.startswith(ours):
            frame, level = frame.f_back, level + 1
        warnings.warn(validation.LAYOUT_ALIAS_DEPRECATED, DeprecationWarning, stacklevel=level)
    folded = {name: x for name, x in kwargs.items() if name != "transpose_state_layout"}
    return {**folded, "state_v_first": kwargs["transpose_state_layout"]}


def _chunk_refusal(args: tuple, kwargs: dict) -> str | None:
    """Why kda does not take ``fla.ops.kda.chunk_kda(*args, **kwargs)``, or None."""
    from kda import api, dispatch

    _handoff.kept = None
    kwargs = _fold_layout_alias(kwargs, warn=False)
    ctx = kwargs.get("cp_context")
    if ctx is not None:  # kda takes fla's contiguous layout (kda.context_parallel.from_fla_cp_context)
        layout = getattr(ctx, "layout", None)
        if layout != "contiguous" or getattr(ctx, "cu_seqlens", None) is None:
            return f"cp_context with layout={layout!r}: kda takes the contiguous layout only"
        # this rank's call as kda checks it: its own tokens, described by the context's local offsets
        kwargs = {**kwargs, "cp_context": None, "cu_seqlens": ctx.cu_seqlens, "cu_seqlens_cpu": ctx.cu_seqlens_cpu}
    try:
        problem = api.checked_problem(api.chunk_kda, *args, **kwargs)
    except (TypeError, ValueError) as err:
        return f"kda cannot take the call: {err}"
    chosen = _auto_choice(problem, dispatch)
    if chosen == "torch" and problem.q.is_cuda:
        return f"kda would run its torch reference here ({problem.describe()}); fla's kernels are faster"
    if ctx is None:
        _keep_host_offsets(kwargs.get("cu_seqlens"), problem)
    return None


def _auto_choice(problem, dispatch) -> str:
    """The backend kda's ``auto`` picks for ``problem``, without logging it."""
    for name in dispatch.AUTO_ORDER:
        backend = dispatch.get_backend(name)
        if dispatch.refusal(backend, problem) is None and backend.auto_rejects(problem) is None:
            return name
    return "torch"


def _decode_refusal(call: dict) -> str | None:
    """Why kda does not take fla's ``fused_recurrent_kda_fwd`` call (its arguments by name)."""
    from kda import api, dispatch

    _handoff.kept = None
    if call.get("out") is not None:
        return "`out` is not supported by kda"
    if not call["inplace_final_state"] and (
        call["ssm_state_indices"] is not None or call["num_accepted_tokens"] is not None
    ):
        # fla then starts sequence n from initial_state[ssm_state_indices[n]] and returns the final
        # states apart; kda takes slot indices with the pool updated in place only (the call ran
        # as a plain one from initial_state[n] until a review of 2026-12-04: o 0.88 off).
        return "`ssm_state_indices` / `num_accepted_tokens` without `inplace_final_state` (fla's kernel takes them)"
    try:
        problem = _decode_problem(api, call)
    except (TypeError, ValueError) as err:
        return f"kda cannot take the call: {err}"
    if problem.q.is_cuda and _auto_choice(problem, dispatch) == "torch":
        return f"kda would run its torch reference here ({problem.describe()}); fla's kernel is faster"
    _keep_host_offsets(call["cu_seqlens"], problem)
    return None


def _decode_problem(api, call: dict):
    """kda's checked call for fla's decode arguments: a pool call when fla updates the state
    in place (slot n for sequence n, or the slots of ``ssm_state_indices``), else a plain one."""
    c = call
    if c["inplace_final_state"]:
        return api.pooled_problem(
            c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"], c["scale"], c["initial_state"],
            c["use_qk_l2norm_in_kernel"], c["use_gate_in_kernel"], c["use_beta_sigmoid_in_kernel"],
            c["allow_neg_eigval"], c["lower_bound"], c["state_v_first"], c["cu_seqlens"], None, True,
            c["ssm_state_indices"], c["num_accepted_tokens"], {},
        )  # fmt: skip
    return api.checked_problem(
        api.fused_recurrent_kda, c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"], c["scale"],
        c["initial_state"], c["output_final_state"], c["use_qk_l2norm_in_kernel"], c["use_gate_in_kernel"],
        c["use_beta_sigmoid_in_kernel"], c["allow_neg_eigval"], c["lower_bound"], c["state_v_first"], c["cu_seqlens"],
    )  # fmt: skip


def _make_backends():
    """fla adapter classes (fla's BaseBackend subclasses), built once fla is imported."""
    from fla.backends import BaseBackend

    class KDAChunkBackend(BaseBackend):
        """kda's chunk_kda for ``fla.ops.kda.chunk_kda``."""

        backend_type = BACKEND_TYPE
        env_var = ENV_VAR
        priority = PRIORITY

        def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            reason = _chunk_refusal(args, kwargs)
            return reason is None, reason

        def chunk_kda(self, *args, **kwargs):
            import kda

            kwargs = _fold_layout_alias(kwargs, warn=True)
            # (cu_seqlens by keyword, as fla's layers pass it; given positionally, the call copies it again)
            host = _host_offsets(kwargs.get("cu_seqlens"))
            if host is not None and kwargs.get("cu_seqlens_cpu") is None:
                kwargs = {**kwargs, "cu_seqlens_cpu": host}
            return kda.chunk_kda(*args, **kwargs)  # a contiguous cp_context included

    class KDADecodeBackend(BaseBackend):
        """kda's fused_recurrent_kda for fla's dispatched ``fused_recurrent_kda_fwd``."""

        backend_type = BACKEND_TYPE
        env_var = ENV_VAR
        priority = PRIORITY

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            bound = inspect.signature(self.fused_recurrent_kda_fwd).bind(*args, **kwargs)
            bound.apply_defaults()
            reason = _decode_refusal(bound.arguments)
            return reason is None, reason

        def fused_recurrent_kda_fwd(
            self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
            output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
            ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
            out=None, **kwargs,
        ):  # fmt: skip
            import kda

            host = _host_offsets(cu_seqlens)
            if inplace_final_state:  # fla's contract: the pool in initial_state is updated in place
                return kda.fused_recurrent_kda(
                    q, k, v, g, beta, A_log, dt_bias, scale, initial_state, False, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                    cu_seqlens, cu_seqlens_cpu=host, inplace_final_state=True, ssm_state_indices=ssm_state_indices,
                    num_accepted_tokens=num_accepted_tokens,
                )  # fmt: skip
            return kda.fused_recurrent_kda(
                q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                cu_seqlens, cu_seqlens_cpu=host,
            )  # fmt: skip

    return KDAChunkBackend, KDADecodeBackend


def register_fla_backend() -> bool:
    """Register kda in fla's backend registry for ``fla.ops.kda.chunk_kda`` and fla's decode
    entry point. Idempotent. Returns False (and registers nothing) when fla, or a version of
    it with ``fla.backends``, is not installed."""
    global _registered
    with _lock:
        if _registered:
            return True
        try:
            from fla.backends import register
            from fla.ops.kda import chunk as fla_chunk
        except ImportError:
            return False
        chunk_backend, decode_backend = _make_backends()
        register(fla_chunk.chunk_kda)(chunk_backend)
        register("kda")(decode_backend)
        _registered = True
        return True
