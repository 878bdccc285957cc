"""All argument checking of the public API, in one place, before anything is launched.

:func:`check_chunk_kda` and :func:`check_fused_recurrent_kda` turn the fla-style arguments
into one :class:`Problem` or raise ValueError / TypeError naming the argument and what was
expected. Backends receive only checked problems and never re-validate.
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass

import torch

MAX_HEAD_DIM = 256
SAFE_LOWER_BOUND_MIN = -5.0
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Keyword arguments of fla 0.6.0 that this package accepts and ignores (they tune fla's own
# kernels, not the function computed).
IGNORED_KWARGS = ("chunk_size", "use_graph", "max_num_seqs")


@dataclass(slots=True)  # slots: a third less host time to build, once per call
class Problem:
    """A checked KDA forward call. Tensors are contiguous; flags are plain Python values."""

    op: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    use_qk_l2norm: bool
    use_gate: bool
    use_beta_sigmoid: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: float | None
    A_log: torch.Tensor | None  # [HV] float32, only with use_gate
    dt_bias: torch.Tensor | None  # [HV * K] or [HV, K] float32, only with use_gate
    state_v_first: bool
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None  # host copy of cu_seqlens (given, or made when checking it)
    cu_seqlens_values: tuple[int, ...] | None  # cu_seqlens as Python ints (the chunk tables' cache key)
    requires_grad: bool  # autograd will want a backward through this call
    final_state_dtype: torch.dtype  # of the returned final state: float32 (fla's) unless asked otherwise

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def HV(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def N(self) -> int:
        """Number of sequences (state slots)."""
        return self.B if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    @property
    def gate_form(self) -> str:
        """``"precomputed"``, ``"lower_bound"`` or ``"softplus"``."""
        if not self.use_gate:
            return "precomputed"
        return "lower_bound" if self.lower_bound is not None else "softplus"

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """``[N, HV, V, K]`` with ``state_v_first``, else ``[N, HV, K, V]``."""
        _, _, HV, V = self.v.shape  # each shape read builds a torch.Size: one per tensor
        N, K = self.N, self.q.shape[3]
        return (N, HV, V, K) if self.state_v_first else (N, HV, K, V)

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype the state is carried in: float64 for float64 inputs, else float32."""
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    def describe(self) -> str:
        mode = f"varlen N={self.N}" if self.cu_seqlens is not None else f"B={self.B}"
        return (
            f"{self.op}({mode}, T={self.T}, H={self.H}, HV={self.HV}, K={self.K}, V={self.V}, "
            f"{str(self.q.dtype).removeprefix('torch.')}, gate={self.gate_form})"
        )


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if x.shape != expected:  # torch.Size is a tuple
        raise ValueError(f"`{name}` must have shape {what}={list(expected)}, got {list(x.shape)}")


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"`{name}` is on {x.device} but `q` is on {device}; all tensors must share a device")


def _any_requires_grad(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    # A loop, not any() over a generator (ruff's SIM110): half the host time.
    for x in tensors:  # noqa: SIM110
        if x is not None and x.requires_grad:
            return True
    return False


def _check_cu_seqlens(
    cu_seqlens: object, cu_seqlens_cpu: object, B: int, T: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, ...] | None]:
    """``(cu_seqlens, its host copy, its values as Python ints)``, or three Nones."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
        return None, None, None
    cu = _require_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype != torch.int64:
        raise TypeError(f"`cu_seqlens` must be int64 (torch.long), got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"`cu_seqlens` must be 1-D with at least 2 entries [N+1], got shape {list(cu.shape)}")
    _require_device("cu_seqlens", cu, device)
    if B != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (flatten the sequences), got B={B}")
    if cu_seqlens_cpu is not None:
        host = _require_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
        if not host.is_cpu or host.dtype != torch.int64 or host.shape != cu.shape:
            raise ValueError(
                f"`cu_seqlens_cpu` must be an int64 CPU copy of `cu_seqlens` with shape {list(cu.shape)}, "
                f"got {host.dtype} on {host.device} with shape {list(host.shape)}"
            )
        values = host
    else:
        if cu.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "`cu_seqlens_cpu` is required while capturing a CUDA graph (checking `cu_seqlens` "
                "would copy it to the host, which a capture cannot do)"
            )
        values = cu.cpu()  # one host sync; pass cu_seqlens_cpu to avoid it
    # One tolist and Python comparisons: each small torch op (index, compare, any, item) is a
    # dispatcher round trip of about a microsecond, against a 40 us host budget per call.
    offsets = tuple(values.tolist())
    if offsets[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {offsets[0]}")
    if not all(map(operator.le, offsets, offsets[1:])):
        raise ValueError("`cu_seqlens` must be non-decreasing")
    if offsets[-1] != T:
        raise ValueError(f"`cu_seqlens` must end at T={T} (the flattened length), got {offsets[-1]}")
    return cu.contiguous(), values, offsets


def _check_gate_params(
    A_log: object, dt_bias: object, HV: int, K: int, device: torch.device, lower_bound: float | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if A_log is None:
        if lower_bound is None:
            raise ValueError("`A_log` must be given when `use_gate_in_kernel=True` and `lower_bound` is not set")
    else:
        a = _require_tensor("A_log", A_log)
        if a.numel() != HV:
            raise ValueError(f"`A_log` must have HV={HV} elements (shape [HV]), got shape {list(a.shape)}")
        _require_device("A_log", a, device)
        # A reshape or a dtype conversion costs about a microsecond even when it changes nothing.
        A_log = _float32_contiguous(a if a.ndim == 1 else a.reshape(HV))
    if dt_bias is not None:
        d = _require_tensor("dt_bias", dt_bias)
        if d.numel() != HV * K or d.shape[-1] not in (K, HV * K):
            raise ValueError(f"`dt_bias` must have shape [HV*K]={[HV * K]} or [HV, K]={[HV, K]}, got {list(d.shape)}")
        _require_device("dt_bias", d, device)
        dt_bias = _float32_contiguous(d if d.shape in ((HV * K,), (HV, K)) else d.reshape(HV, K))
    return A_log, dt_bias


def _float32_contiguous(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype == torch.float32 else x.float()).contiguous()


def _pop_state_layout(state_v_first: bool, kwargs: dict) -> bool:
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass either `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn(
            "`transpose_state_layout` is deprecated; use `state_v_first`",
            DeprecationWarning,
            stacklevel=5,  # the caller of chunk_kda / fused_recurrent_kda
        )
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    return bool(state_v_first)


def _check_kwargs(kwargs: dict) -> None:
    if not kwargs:  # the usual call
        return
    if kwargs.get("head_first"):
        raise ValueError("`head_first=True` is not supported by KDA: pass [B, T, H, K] tensors")
    kwargs.pop("head_first", None)
    if kwargs.get("cp_context") is not None:
        raise ValueError("`cp_context` (context parallelism) is not supported")
    kwargs.pop("cp_context", None)
    for name in IGNORED_KWARGS:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kwargs))}")


def _check_problem(op: str, args: dict, kwargs: dict) -> Problem:
    kwargs = dict(kwargs)
    state_v_first = _pop_state_layout(args["state_v_first"], kwargs)
    A_log = args.get("A_log", kwargs.pop("A_log", None))
    dt_bias = args.get("dt_bias", kwargs.pop("dt_bias", None))
    _check_kwargs(kwargs)

    # Checks written out one by one, not looped over (name, tensor) pairs: the loops cost a
    # third more host time, and this runs on every call.
    q = _require_tensor("q", args["q"])
    k = _require_tensor("k", args["k"])
    v = _require_tensor("v", args["v"])
    g = _require_tensor("g", args["g"])
    beta = _require_tensor("beta", args["beta"])
    if q.ndim != 4:
        raise ValueError(f"`q` must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    _require_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"`v` must be 4-D [B, T, HV, V] with B={B}, T={T}, got shape {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    _require_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if min(H, HV, K, V) < 1:
        raise ValueError(f"head counts and head dims must be >= 1, got H={H}, HV={HV}, K={K}, V={V}")
    if HV % H != 0:
        raise ValueError(f"`v` has HV={HV} heads, which must be a multiple of the H={H} heads of `q`")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}, got K={K} (`q`), V={V} (`v`)")

    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"`q` must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"`{name}` has dtype {x.dtype} but `q` has {q.dtype}; q, k, v must match")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype not in (q.dtype, torch.float32, torch.float64):
            raise TypeError(f"`{name}` must have q's dtype ({q.dtype}) or float32, got {x.dtype}")
    device = q.device
    _require_device("k", k, device)
    _require_device("v", v, device)
    _require_device("g", g, device)
    _require_device("beta", beta, device)

    cu_seqlens, cu_seqlens_cpu, cu_seqlens_values = _check_cu_seqlens(
        args["cu_seqlens"], args.get("cu_seqlens_cpu"), B, T, device
    )
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1

    # States: float32 (fla's only choice) or bfloat16 (kda's extension; carried in float32
    # inside), float64 with float64 inputs.
    state_dtypes = (torch.float64,) if q.dtype == torch.float64 else (torch.float32, torch.bfloat16)
    state_names = "float64" if q.dtype == torch.float64 else "float32 or bfloat16"
    initial_state = args["initial_state"]
    if initial_state is not None:
        h0 = _require_tensor("initial_state", initial_state)
        layout, dims = ("[N, HV, V, K]", (N, HV, V, K)) if state_v_first else ("[N, HV, K, V]", (N, HV, K, V))
        _require_shape("initial_state", h0, dims, layout)
        if h0.dtype not in state_dtypes:
            raise TypeError(f"`initial_state` must be {state_names} for {q.dtype} inputs, got {h0.dtype}")
        _require_device("initial_state", h0, device)
        initial_state = h0.contiguous()

    final_state_dtype = args.get("final_state_dtype")
    if final_state_dtype is None:
        final_state_dtype = state_dtypes[0]
    elif final_state_dtype not in state_dtypes:
        raise TypeError(
            f"`final_state_dtype` must be None or torch.{state_names.replace(' or ', ' or torch.')} for "
            f"{q.dtype} inputs, got {final_state_dtype!r}"
        )

    scale = args["scale"]
    if scale is None:
        scale = K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"`scale` must be a finite float or None, got {scale!r}")

    use_gate = bool(args["use_gate_in_kernel"])
    use_beta_sigmoid = bool(args["use_beta_sigmoid_in_kernel"])
    allow_neg_eigval = bool(args["allow_neg_eigval"])
    safe_gate = bool(args.get("safe_gate", False))
    lower_bound = args["lower_bound"]
    if allow_neg_eigval and not use_beta_sigmoid:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"`lower_bound` must be a float or None, got {lower_bound!r}")
        lower_bound = float(lower_bound)
        if not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"`lower_bound` must be a finite negative number, got {lower_bound}")
    if safe_gate and use_gate:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be set when `safe_gate=True` and `use_gate_in_kernel=True`")
        if not SAFE_LOWER_BOUND_MIN <= lower_bound < 0:
            raise ValueError(
                f"`lower_bound` must be in the safe range [-5, 0) with `safe_gate=True`, got {lower_bound}"
            )
    if use_gate:
        A_log, dt_bias = _check_gate_params(A_log, dt_bias, HV, K, device, lower_bound)
    else:
        A_log, dt_bias, lower_bound = None, None, None
    differentiable = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    requires_grad = torch.is_grad_enabled() and _any_requires_grad(differentiable)

    return Problem(
        op=op,
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        g=g.contiguous(),
        beta=beta.contiguous(),
        scale=float(scale),
        initial_state=initial_state,
        output_final_state=bool(args["output_final_state"]),
        use_qk_l2norm=bool(args["use_qk_l2norm_in_kernel"]),
        use_gate=use_gate,
        use_beta_sigmoid=use_beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        A_log=A_log,
        dt_bias=dt_bias,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        cu_seqlens_values=cu_seqlens_values,
        requires_grad=requires_grad,
        final_state_dtype=final_state_dtype,
    )


def check_chunk_kda(args: dict, kwargs: dict) -> Problem:
    """Check the arguments of :func:`kda.chunk_kda` (``args``: its named parameters)."""
    if args["return_intermediate_states"]:
        raise ValueError(
            "`return_intermediate_states=True` is not supported: kda runs chunks of 16, so fla's "
            "chunk-64 intermediate states have no counterpart here"
        )
    return _check_problem("chunk_kda", args, kwargs)


def check_fused_recurrent_kda(args: dict, kwargs: dict) -> Problem:
    """Check the arguments of :func:`kda.fused_recurrent_kda` (``args``: its named parameters)."""
    return _check_problem("fused_recurrent_kda", args, kwargs)
