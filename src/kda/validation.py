"""All argument checking of the public API, in one place, before anything is launched.

:func:`check_chunk_kda` and :func:`check_fused_recurrent_kda` turn the fla-style arguments
into one :class:`Problem` or raise ValueError / TypeError naming the argument and what was
expected. Backends receive only checked problems and never re-validate.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from kda.abi import SAFE_LOWER_BOUND_MIN

MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Per input dtype (q's): the dtypes g and beta may have, and those of the states: float32
# (fla's only choice) or bfloat16 (kda's extension; carried in float32 inside), float64 with
# float64 inputs. One lookup a call instead of building the tuples.
GATE_DTYPES = {dtype: tuple(dict.fromkeys((dtype, torch.float32, torch.float64))) for dtype in FLOAT_DTYPES}
STATE_DTYPES = {dtype: (torch.float32, torch.bfloat16) for dtype in FLOAT_DTYPES} | {torch.float64: (torch.float64,)}
# Keyword arguments of fla 0.6.0 that this package accepts and ignores (they tune fla's own
# kernels, not the function computed).
IGNORED_KWARGS = ("chunk_size", "use_graph", "max_num_seqs")
# Every keyword argument chunk_kda takes in ``**kwargs``: the gate parameters, the deprecated
# state layout flag, fla's unsupported features (refused when set) and the ignored ones.
KNOWN_KWARGS = frozenset(("A_log", "dt_bias", "transpose_state_layout", "head_first", "cp_context", *IGNORED_KWARGS))
# fused_recurrent_kda also takes chunk_kda's own flags that tune fla's chunked kernels (fla's
# swallows them in its **kwargs; one dict of keywords then serves both functions) and ignores them.
RECURRENT_KWARGS = KNOWN_KWARGS | {"safe_gate", "disable_recompute", "return_intermediate_states"}


@dataclass(slots=True)  # slots: a third less host time to build, once per call
class Problem:
    """A checked KDA forward call. Tensors are contiguous; flags are plain Python values.

    The sizes are fields, read from the shapes once while checking: backends read them
    several times a call, and each shape read builds a torch.Size."""

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
    A_log: torch.Tensor | None  # [HV] float32 (float64 for float64 inputs), only with use_gate
    dt_bias: torch.Tensor | None  # [HV * K] or [HV, K], A_log's dtype, only with use_gate
    state_v_first: bool
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None  # host copy of cu_seqlens (given, or made when checking it; None: unchecked)
    cu_seqlens_values: tuple[int, ...] | None  # cu_seqlens as Python ints, where checked on the host
    requires_grad: bool  # autograd will want a backward through this call
    final_state_dtype: torch.dtype  # of the returned final state: float32 (fla's) unless asked otherwise
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int  # number of sequences (state slots): B, or len(cu_seqlens) - 1
    gate_form: str  # "precomputed" (g is the log-decay), "lower_bound" or "softplus"
    # State pools (fused_recurrent_kda with inplace_final_state, spec section 7): the pool
    # (updated in place), the slot indices ([N] or [N, S], or None: slot n) and, with 2-D
    # indices, the accepted tokens [N]. See check_pool.
    pool: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    # Rows of the caller's T past the end of `cu_seqlens` (a padded buffer): the tensors above
    # hold the first T rows only, and the output gets `padding` zero rows (api.run).
    padding: int = 0

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """``[N, HV, V, K]`` with ``state_v_first``, else ``[N, HV, K, V]``."""
        if self.state_v_first:
            return (self.N, self.HV, self.V, self.K)
        return (self.N, self.HV, self.K, self.V)

    @property
    def lengths_unchecked(self) -> bool:
        """A varlen call whose lengths were not read on the host (CHECK_CU_SEQLENS, a capture, a
        call traced by torch.compile: its host copy, if any, is read when the operator runs)."""
        return self.cu_seqlens is not None and self.cu_seqlens_values is None

    @property
    def longest(self) -> int:
        """Tokens in the longest sequence (from the checked offsets as Python ints; without them,
        varlen calls answer T, the most a sequence can have). Python arithmetic: the three torch
        ops on the host copy it replaced took 33 us of a 40 us budget (CPU, 2026-12-01)."""
        values = self.cu_seqlens_values
        if values is None:
            return self.T
        return max(map(operator.sub, values[1:], values[:-1]), default=0)

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


# The checks below run on every call, against a host budget of tens of microseconds: each
# condition is tested inline (a helper call costs about 0.1 us) and the helpers only build
# the error, once a condition has failed.


def _real_or_none(x: object) -> float | None:
    """A real number (Python or numpy, any float width; not bool) as a float, inf for an integer past
    the float range (so that the caller's finiteness check names it); None for anything else."""
    if type(x) is float:  # the usual case first: an ABC check costs host time on every call
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _require_4d_q(q: Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"`q` must be 4-D [B, T, H, K], got shape {list(q.shape)}")


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_tensors(**named: object) -> None:
    for name, x in named.items():
        _require_tensor(name, x)


def _shape_error(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> ValueError:
    return ValueError(f"`{name}` must have shape {what}={list(expected)}, got {list(x.shape)}")


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"`{name}` is on {x.device} but `q` is on {device}; all tensors must share a device")


def _require_devices(device: torch.device, **named: torch.Tensor) -> None:
    for name, x in named.items():
        _require_device(name, x, device)


def _any_requires_grad(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    # A loop, not any() over a generator (ruff's SIM110): half the host time.
    for x in tensors:  # noqa: SIM110
        if x is not None and x.requires_grad:
            return True
    return False


OFFSET_DTYPES = (torch.int64, torch.int32)
# How `cu_seqlens` on a GPU is checked (README, "Varlen"). The kernels read it on the device
# (kda.tables clamps what they read, so no value can take them outside a tensor); the values
# are checked on the host:
#   unset: from `cu_seqlens_cpu` when given (no sync), else from one copy to the host (a sync);
#   "1":   that, and `cu_seqlens_cpu` compared with `cu_seqlens` (a sync: for debugging);
#   "0":   from `cu_seqlens_cpu` when given, else not at all: no call ever syncs.
# A CUDA-graph capture never copies (it could not): its replays take any lengths.
CHECK_CU_SEQLENS = os.environ.get("KDA_CHECK_CU_SEQLENS", "")


def check_graph_offsets(kwargs: dict, N: int) -> None:
    """fla's graph mode (chunk_kda's ``use_graph``): the offsets of N sequences must be padded with
    empty ones to ``max_num_seqs`` (fla asserts it). Of the caller's own offsets only: the calls
    that kda makes itself drop fla's ignored keywords."""
    if kwargs.get("use_graph") and kwargs.get("max_num_seqs") not in (None, N):
        raise ValueError(
            f"with `use_graph=True`, `cu_seqlens` must hold `max_num_seqs` + 1 offsets (max_num_seqs="
            f"{kwargs['max_num_seqs']!r}; pad with empty sequences), got {N + 1}"
        )


def _capturing(x: Tensor) -> bool:
    """dispatch.capturing (the stream of x's GPU, not of the current device; imported here, as
    dispatch imports this module)."""
    from kda.dispatch import capturing

    return capturing(x)


def _offsets_tensor(cu_seqlens: object) -> torch.Tensor:
    """``cu_seqlens`` as a tensor of offsets: int64 or int32, 1-D, at least 2 entries."""
    cu = cu_seqlens if isinstance(cu_seqlens, Tensor) else _require_tensor("cu_seqlens", cu_seqlens)
    if cu.dtype not in OFFSET_DTYPES:
        raise TypeError(f"`cu_seqlens` must be int64 or int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"`cu_seqlens` must be 1-D with at least 2 entries [N+1], got shape {list(cu.shape)}")
    return cu


def _check_cu_seqlens(
    cu_seqlens: object, cu_seqlens_cpu: object, B: int, T: int | None, device: torch.device, defer: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, ...] | None]:
    """``(cu_seqlens, its host copy, its values as Python ints)``, or three Nones. ``T=None``:
    the end is not checked (a context-parallel rank holds a slice of the batch it describes).
    ``defer``: under torch.compile, the values are not read (check_problem's defer_offsets)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
        return None, None, None
    cu = _offsets_tensor(cu_seqlens)
    shape = cu.shape
    if cu.device != device:
        _require_device("cu_seqlens", cu, device)
    if B != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (flatten the sequences), got B={B}")
    host = None
    if cu_seqlens_cpu is not None:
        host = (
            cu_seqlens_cpu if isinstance(cu_seqlens_cpu, Tensor) else _require_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
        )
        if not host.is_cpu or host.dtype not in OFFSET_DTYPES or host.shape != shape:
            raise ValueError(
                f"`cu_seqlens_cpu` must be an int64 or int32 CPU copy of `cu_seqlens` with shape {list(shape)}, "
                f"got {host.dtype} on {host.device} with shape {list(host.shape)}"
            )
    if defer and torch.compiler.is_compiling():
        # dynamo cannot read the values while it traces (under fullgraph, a data-dependent error
        # until 2026-12-07): the call runs through kda::chunk_fwd, which checks them where it runs
        # (autograd._problem; any other route reads them itself: torch_backend.run)
        return cu.long().contiguous(), None if host is None else host.long(), None
    if host is not None:
        # The kernels read `cu_seqlens`; its host copy is what is checked (and what sets the
        # route), so the two must agree. Compared where that costs no device sync: both on the
        # CPU, or with KDA_CHECK_CU_SEQLENS=1 (one sync per call).
        if (cu.is_cpu or CHECK_CU_SEQLENS == "1") and not torch.equal(cu.cpu().long(), host.long()):
            raise ValueError(
                f"`cu_seqlens_cpu` {host.tolist()} disagrees with `cu_seqlens` {cu.tolist()} (the kernels read "
                "`cu_seqlens`; its values are checked from `cu_seqlens_cpu`)"
            )
        values = host
    elif cu.is_cpu:
        values = cu
    elif CHECK_CU_SEQLENS == "0" or _capturing(cu):
        return cu.long().contiguous(), None, None  # unchecked: see CHECK_CU_SEQLENS
    else:
        values = cu.cpu()  # one host sync; pass cu_seqlens_cpu to avoid it
    # One tolist and Python comparisons: each small torch op (index, compare, any, item) is a
    # dispatcher round trip of about a microsecond, against a 40 us host budget per call.
    offsets = tuple(values.tolist())
    if offsets[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {offsets[0]}")
    if not all(map(operator.le, offsets, offsets[1:])):
        raise ValueError("`cu_seqlens` must be non-decreasing")
    # An end before T is a padded buffer (fla's use_graph: zero-length tail sequences, T fixed):
    # check_problem runs the call on the first offsets[-1] tokens and zero-fills the rest.
    if T is not None and offsets[-1] > T:
        raise ValueError(f"`cu_seqlens` must end at most at T={T} (the flattened length), got {offsets[-1]}")
    # int32 offsets (flash-attn's) become int64 here: on the device that is one small copy, no sync
    return cu.long().contiguous(), values.long(), offsets


def check_initial_state(
    initial_state: object, dims: tuple[int, int, int, int], state_v_first: bool, dtype: torch.dtype, device
) -> torch.Tensor:
    """``initial_state`` checked against ``dims`` ``(N, HV, K, V)`` in its layout, the state dtypes
    of ``dtype`` inputs and ``device``; returned contiguous."""
    h0 = initial_state if isinstance(initial_state, Tensor) else _require_tensor("initial_state", initial_state)
    N, HV, K, V = dims
    dims = (N, HV, V, K) if state_v_first else dims
    if h0.shape != dims:
        raise _shape_error("initial_state", h0, dims, "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]")
    if h0.dtype not in STATE_DTYPES[dtype]:
        raise TypeError(f"`initial_state` must be {_state_names(dtype)} for {dtype} inputs, got {h0.dtype}")
    if h0.device != device:
        _require_device("initial_state", h0, device)
    return h0.contiguous()


def _check_gate_params(
    A_log: object,
    dt_bias: object,
    HV: int,
    K: int,
    device: torch.device,
    lower_bound: float | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A_log and dt_bias in ``dtype``: float32 for the kernels, float64 for a float64 call (the
    reference's yardstick keeps every input's precision)."""
    # Each tensor is converted only when needed: a dtype conversion or a helper call costs host
    # time even when it changes nothing.
    if A_log is None:
        if lower_bound is None:
            raise ValueError("`A_log` must be given when `use_gate_in_kernel=True` and `lower_bound` is not set")
    else:
        a = A_log if isinstance(A_log, Tensor) else _require_tensor("A_log", A_log)
        shape = a.shape
        # The usual [HV] passes on one shape comparison; other shapes of HV elements are reshaped.
        if shape != (HV,):
            if a.numel() != HV:
                raise ValueError(f"`A_log` must have HV={HV} elements (shape [HV]), got shape {list(shape)}")
            a = a.reshape(HV)  # a reshape costs about a microsecond even when it changes nothing
        if a.device != device:
            _require_device("A_log", a, device)
        # (a complex A_log lost its imaginary part in the cast, a review of 2026-12-07)
        if a.dtype != dtype and not a.dtype.is_floating_point:
            raise TypeError(f"`A_log` must be a floating-point tensor, got {a.dtype}")
        A_log = (a if a.dtype == dtype else a.to(dtype)).contiguous()
    if dt_bias is not None:
        d = dt_bias if isinstance(dt_bias, Tensor) else _require_tensor("dt_bias", dt_bias)
        shape = d.shape
        if shape != (HV * K,) and shape != (HV, K):
            if d.numel() != HV * K or not shape or shape[-1] not in (K, HV * K):
                raise ValueError(f"`dt_bias` must have shape [HV*K]={[HV * K]} or [HV, K]={[HV, K]}, got {list(shape)}")
            d = d.reshape(HV, K)
        if d.device != device:
            _require_device("dt_bias", d, device)
        if d.dtype != dtype and not d.dtype.is_floating_point:
            raise TypeError(f"`dt_bias` must be a floating-point tensor, got {d.dtype}")
        dt_bias = (d if d.dtype == dtype else d.to(dtype)).contiguous()
    return A_log, dt_bias


LAYOUT_ALIAS_DEPRECATED = "`transpose_state_layout` is deprecated; use `state_v_first`"


def fold_state_layout(state_v_first: object, kwargs: dict, stacklevel: int) -> object:
    """``state_v_first``, or fla's deprecated ``transpose_state_layout`` of ``kwargs`` in its place
    (with a DeprecationWarning at ``stacklevel``; both given is an error). chunk_kda folds it in
    on entry (the segment split and context parallelism read ``state_v_first`` alone);
    fused_recurrent_kda through :func:`_check_kwargs`."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass either `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn(LAYOUT_ALIAS_DEPRECATED, DeprecationWarning, stacklevel)
        state_v_first = kwargs["transpose_state_layout"]
    return state_v_first


def _check_kwargs(op: str, state_v_first: object, kwargs: dict) -> object:
    """Check fla's extra keyword arguments (read, never popped: the caller's dict may be reused)
    and return ``state_v_first``, or the deprecated ``transpose_state_layout`` in its place."""
    # stacklevel 5: the caller of chunk_kda / fused_recurrent_kda (through check_problem)
    state_v_first = fold_state_layout(state_v_first, kwargs, stacklevel=5)
    if kwargs.get("head_first"):
        raise ValueError("`head_first=True` is not supported by KDA: pass [B, T, H, K] tensors")
    if kwargs.get("cp_context") is not None:  # chunk_kda takes it before checking (kda.context_parallel)
        raise ValueError("`cp_context` (context parallelism) is taken by chunk_kda only")
    known = KNOWN_KWARGS if op == "chunk_kda" else RECURRENT_KWARGS
    if not kwargs.keys() <= known:  # a subset test builds no set
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kwargs.keys() - known))}")
    # Ignored (kda's chunks are 16 tokens), but what fla refuses is refused (a review, 2026-12-04).
    if kwargs.get("chunk_size", 64) not in (32, 64):
        raise ValueError(
            f"`chunk_size` must be either 32 or 64 (fla's choices; kda ignores it), got {kwargs['chunk_size']}"
        )
    return state_v_first


def check_problem(
    op: str,
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    scale: object,
    initial_state: object,
    output_final_state: object,
    use_qk_l2norm_in_kernel: object,
    use_gate_in_kernel: object,
    use_beta_sigmoid_in_kernel: object,
    allow_neg_eigval: object,
    safe_gate: object,
    lower_bound: object,
    A_log: object,
    dt_bias: object,
    return_intermediate_states: object,
    state_v_first: object,
    cu_seqlens: object,
    cu_seqlens_cpu: object,
    final_state_dtype: object,
    kwargs: dict,
    defer_offsets: bool = False,
) -> Problem:
    """Check one call of ``op`` (the public function's arguments in this order, positionally:
    a third of the host time of passing them in a dict) and return its :class:`Problem`.
    ``kwargs``: fla's extra keyword arguments, read and never popped. ``defer_offsets``: a call
    a kernel backend would run through kda::chunk_fwd, whose offsets, under torch.compile, are
    left for the operator to read and check (_check_cu_seqlens)."""
    if return_intermediate_states:
        raise ValueError(
            "`return_intermediate_states=True` is not supported: kda runs chunks of 16, so fla's "
            "chunk-64 intermediate states have no counterpart here"
        )
    if kwargs:
        state_v_first = _check_kwargs(op, state_v_first, kwargs)
    state_v_first = bool(state_v_first)

    if not (
        isinstance(q, Tensor)
        and isinstance(k, Tensor)
        and isinstance(v, Tensor)
        and isinstance(g, Tensor)
        and isinstance(beta, Tensor)
    ):
        _require_tensors(q=q, k=k, v=v, g=g, beta=beta)
    q_shape = q.shape
    _require_4d_q(q)
    B, T, H, K = q_shape
    if k.shape != q_shape:
        raise _shape_error("k", k, q_shape, "[B, T, H, K]")
    v_shape = v.shape
    if len(v_shape) != 4 or v_shape[0] != B or v_shape[1] != T:
        raise ValueError(f"`v` must be 4-D [B, T, HV, V] with B={B}, T={T}, got shape {list(v_shape)}")
    _, _, HV, V = v_shape
    if g.shape != (B, T, HV, K):
        raise _shape_error("g", g, (B, T, HV, K), "[B, T, HV, K]")
    if beta.shape != (B, T, HV):
        raise _shape_error("beta", beta, (B, T, HV), "[B, T, HV]")
    if H < 1 or HV < 1 or K < 1 or V < 1:
        raise ValueError(f"head counts and head dims must be >= 1, got H={H}, HV={HV}, K={K}, V={V}")
    if HV % H != 0:
        raise ValueError(f"`v` has HV={HV} heads, which must be a multiple of the H={H} heads of `q`")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}, got K={K} (`q`), V={V} (`v`)")

    dtype = q.dtype
    gate_dtypes = GATE_DTYPES.get(dtype)
    if gate_dtypes is None:
        raise TypeError(f"`q` must be float16, bfloat16, float32 or float64, got {dtype}")
    if k.dtype != dtype or v.dtype != dtype:
        for name, x in (("k", k), ("v", v)):
            if x.dtype != dtype:
                raise TypeError(f"`{name}` has dtype {x.dtype} but `q` has {dtype}; q, k, v must match")
    if g.dtype not in gate_dtypes or beta.dtype not in gate_dtypes:
        for name, x in (("g", g), ("beta", beta)):
            if x.dtype not in gate_dtypes:
                allowed = " or ".join(str(d) for d in gate_dtypes)
                raise TypeError(f"`{name}` must be {allowed} (q's dtype or a wider float), got {x.dtype}")
    device = q.device
    if k.device != device or v.device != device or g.device != device or beta.device != device:
        _require_devices(device, k=k, v=v, g=g, beta=beta)

    cu_seqlens, cu_seqlens_cpu, cu_seqlens_values = _check_cu_seqlens(
        cu_seqlens, cu_seqlens_cpu, B, T, device, defer=defer_offsets
    )
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if kwargs and op == "chunk_kda" and cu_seqlens is not None:
        check_graph_offsets(kwargs, N)
    padding = 0
    if cu_seqlens_values is not None and cu_seqlens_values[-1] != T and not _capturing(q):
        # A padded buffer: the call runs on the tokens the offsets cover (views, B == 1) and
        # the api zero-fills the output's last `padding` rows (whose gradients are then zero).
        # Not under a CUDA-graph capture, whose replays may cover more rows than the host copy
        # said: the kernels run all T rows there and read the end from `cu_seqlens`.
        padding, T = T - cu_seqlens_values[-1], cu_seqlens_values[-1]
        q, k, v, g, beta = q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T]

    state_dtypes = STATE_DTYPES[dtype]
    if initial_state is not None:
        initial_state = check_initial_state(initial_state, (N, HV, K, V), state_v_first, dtype, device)

    if final_state_dtype is None:
        final_state_dtype = state_dtypes[0]
    elif final_state_dtype not in state_dtypes:
        raise TypeError(
            f"`final_state_dtype` must be None or torch.{_state_names(dtype).replace(' or ', ' or torch.')} for "
            f"{dtype} inputs, got {final_state_dtype!r}"
        )

    if scale is None:
        scale = K**-0.5
    else:
        given, scale = scale, _real_or_none(scale)
        # (comparisons, not math.isfinite: under torch.compile a float argument can be symbolic,
        # which math.isfinite cannot read; NaN fails both; a review of 2026-12-07)
        if scale is None or not -math.inf < scale < math.inf:
            raise TypeError(f"`scale` must be a finite float or None, got {given!r}")

    use_gate = bool(use_gate_in_kernel)
    use_beta_sigmoid = bool(use_beta_sigmoid_in_kernel)
    allow_neg_eigval = bool(allow_neg_eigval)
    safe_gate = bool(safe_gate)
    if allow_neg_eigval and not use_beta_sigmoid:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    if lower_bound is not None:
        given, lower_bound = lower_bound, _real_or_none(lower_bound)
        if lower_bound is None:
            raise TypeError(f"`lower_bound` must be a float or None, got {given!r}")
        # (checked where it is used: fla ignores it without the gate in the kernel, and so does kda)
        if use_gate and not -math.inf < lower_bound < 0:
            raise ValueError(f"`lower_bound` must be a finite negative number, got {lower_bound}")
    if safe_gate and use_gate:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be set when `safe_gate=True` and `use_gate_in_kernel=True`")
        if not SAFE_LOWER_BOUND_MIN <= lower_bound < 0:
            raise ValueError(
                f"`lower_bound` must be in the safe range [-5, 0) with `safe_gate=True`, got {lower_bound}"
            )
    if use_gate:
        gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        A_log, dt_bias = _check_gate_params(A_log, dt_bias, HV, K, device, lower_bound, gate_dtype)
        gate_form = "softplus" if lower_bound is None else "lower_bound"
    else:
        A_log, dt_bias, lower_bound, gate_form = None, None, None, "precomputed"
    # q to beta are never None: read directly, a third of the loop's time; the optional three loop.
    requires_grad = torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or g.requires_grad
        or beta.requires_grad
        or _any_requires_grad((A_log, dt_bias, initial_state))
    )

    # Positional, in field order: keyword construction of these 31 fields costs six times as
    # much (2.5 us against 0.4).
    problem = Problem(
        op, q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        float(scale), initial_state, bool(output_final_state), bool(use_qk_l2norm_in_kernel),
        use_gate, use_beta_sigmoid, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, state_v_first,
        cu_seqlens, cu_seqlens_cpu, cu_seqlens_values, requires_grad, final_state_dtype,
        B, T, H, K, HV, V, N, gate_form,
    )  # fmt: skip
    if padding:
        problem.padding = padding
    return problem


def _state_names(dtype: torch.dtype) -> str:
    return " or ".join(str(state).removeprefix("torch.") for state in STATE_DTYPES[dtype])


def check_chunk_kda(args: dict, kwargs: dict) -> Problem:
    """:func:`check_problem` for :func:`kda.chunk_kda`'s arguments as a dict (``args``: its
    named parameters; ``kwargs``: its extra keyword arguments, where A_log and dt_bias go)."""
    return _check_dict("chunk_kda", args, kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs)


def check_fused_recurrent_kda(args: dict, kwargs: dict) -> Problem:
    """:func:`check_problem` for :func:`kda.fused_recurrent_kda`'s arguments as a dict."""
    return _check_dict("fused_recurrent_kda", args, args.get("A_log"), args.get("dt_bias"), kwargs)


def _check_dict(op: str, args: dict, A_log: object, dt_bias: object, kwargs: dict) -> Problem:
    get = args.get
    return check_problem(
        op, args["q"], args["k"], args["v"], args["g"], args["beta"], get("scale"), get("initial_state"),
        get("output_final_state", False), get("use_qk_l2norm_in_kernel", False), get("use_gate_in_kernel", False),
        get("use_beta_sigmoid_in_kernel", False), get("allow_neg_eigval", False), get("safe_gate", False),
        get("lower_bound"), A_log, dt_bias, get("return_intermediate_states", False), get("state_v_first", False),
        get("cu_seqlens"), get("cu_seqlens_cpu"), get("final_state_dtype"), kwargs,
    )  # fmt: skip


INDEX_DTYPES = (torch.int32, torch.int64)


def _require_pool_final_dtype(final_state_dtype: object, pool: torch.Tensor, how: str) -> None:
    """A call that writes its final states into a pool (``how``: by which argument) returns them
    in the pool's dtype: ``final_state_dtype`` must be None or that dtype."""
    if final_state_dtype is not None and final_state_dtype != pool.dtype:
        raise TypeError(
            f"`final_state_dtype` with {how} must be None or the pool's dtype {pool.dtype} "
            f"(the final states are written into the pool), got {final_state_dtype}"
        )


def _require_pool_shape(x: torch.Tensor, HV: int, K: int, V: int, state_v_first: bool) -> None:
    """A state pool is ``[P, HV, K, V]`` (``[P, HV, V, K]`` with state_v_first)."""
    want = (HV, V, K) if state_v_first else (HV, K, V)
    if x.dim() != 4 or tuple(x.shape[1:]) != want:
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        raise ValueError(f"`initial_state` (the state pool) must be {layout} with HV={HV}, K={K}, V={V}, "
                         f"got shape {list(x.shape)}")  # fmt: skip


def check_pool(
    p: Problem, pool: object, indices: object, accepted: object, final_state_dtype: object = None
) -> Problem:
    """Attach a state pool to ``p`` (a fused_recurrent_kda call checked without its initial
    state): ``pool`` ``[P, HV, K, V]`` (``[P, HV, V, K]`` with state_v_first), contiguous, in
    the state dtype; ``indices`` None (sequence n is slot n; then P must be N), ``[N]`` or
    ``[N, S]`` with S at least the longest sequence; ``accepted`` ``[N]``, only with 2-D
    indices; ``final_state_dtype`` (as the caller gave it) None or the pool's. The index values
    are not read here (that would synchronise): the kernels treat one outside ``[0, P)`` as no
    slot."""
    if p.requires_grad:
        raise ValueError("state pools (`inplace_final_state=True`) have no backward: call without grad")
    x = _require_tensor("initial_state", pool)
    _require_pool_shape(x, p.HV, p.K, p.V, p.state_v_first)
    pool_dtypes = (torch.float64,) if p.state_dtype == torch.float64 else (torch.float32, torch.bfloat16)
    if x.dtype not in pool_dtypes:  # a bfloat16 pool: half the bytes; the state is carried in float32
        raise TypeError(f"`initial_state` (the state pool) must be {' or '.join(map(str, pool_dtypes))}, "
                        f"got {x.dtype}")  # fmt: skip
    if x.device != p.q.device:
        _require_device("initial_state", x, p.q.device)
    if not x.is_contiguous():
        raise ValueError("`initial_state` (the state pool) must be contiguous: it is updated in place")
    _require_pool_final_dtype(final_state_dtype, x, "a state pool (`inplace_final_state=True`)")
    P = x.shape[0]
    idx = None
    if indices is None:
        if accepted is not None:
            raise ValueError("`num_accepted_tokens` needs 2-D `ssm_state_indices` [N, S]")
        if P != p.N:
            raise ValueError(f"without `ssm_state_indices` sequence n uses slot n: the pool needs N={p.N} slots, "
                             f"got P={P}")  # fmt: skip
    else:
        idx = _require_tensor("ssm_state_indices", indices)
        if idx.dtype not in INDEX_DTYPES:
            raise TypeError(f"`ssm_state_indices` must be int32 or int64, got {idx.dtype}")
        if idx.device != p.q.device:
            _require_device("ssm_state_indices", idx, p.q.device)
        # columns 2-D indices need: the longest sequence's tokens, and one even without tokens (the
        # first slot is read from column 0); with unchecked lengths (validation.CHECK_CU_SEQLENS)
        # one, as the kernel stops each sequence at S
        columns = 1 if p.lengths_unchecked else max(p.longest, 1)
        if idx.dim() == 1 and idx.shape[0] == p.N:
            if accepted is not None:
                raise ValueError("`num_accepted_tokens` needs 2-D `ssm_state_indices` [N, S]")
        elif idx.dim() == 2 and idx.shape[0] == p.N and idx.shape[1] >= columns:
            if accepted is not None:
                acc = _require_tensor("num_accepted_tokens", accepted)
                if acc.dtype not in INDEX_DTYPES or acc.shape != (p.N,):
                    raise ValueError(f"`num_accepted_tokens` must be int32 or int64 [N={p.N}], got {acc.dtype} "
                                     f"{list(acc.shape)}")  # fmt: skip
                if acc.device != p.q.device:
                    _require_device("num_accepted_tokens", acc, p.q.device)
                p.accepted = acc.contiguous()
        else:
            raise ValueError(f"`ssm_state_indices` must be [N={p.N}] or [N={p.N}, S] with S >= {columns} "
                             f"(the longest sequence), got {list(idx.shape)}")  # fmt: skip
        idx = idx.contiguous()
    p.pool, p.state_indices = x, idx
    return p


def pool_prefill_sequences(
    q: object, pool: object, indices: object, cu_seqlens: object, inputs: tuple = (), final_state_dtype: object = None,
    state_v_first: bool = False,
) -> tuple[int, torch.Tensor]:  # fmt: skip
    """Check chunk_kda's ``initial_state_indices`` and its pool (the state's other checks follow
    on the gathered states; ``inputs``: the call's other tensors, k and v first, for the grad
    check and the pool's [HV, K, V]; ``final_state_dtype``: None or the pool's, as the final
    states go into the pool); returns N, the number of sequences, and the indices contiguous
    (the GPU's scatter kernel reads them at unit stride: a strided view wrote other slots, a
    review of 2026-12-04). ``cu_seqlens`` and the pool's state shape are checked here, before
    N is taken from the one and states are gathered from the other (both were reported as
    errors in other arguments until a review of 2026-12-05)."""
    x = _require_tensor("initial_state", pool)
    idx = _require_tensor("initial_state_indices", indices)
    q = _require_tensor("q", q)
    _require_4d_q(q)  # (before its B is read: a 0-d q raised an IndexError, a review of 2026-12-07)
    N = q.shape[0] if cu_seqlens is None else _offsets_tensor(cu_seqlens).shape[0] - 1
    if idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"`initial_state_indices` must be int32 or int64, got {idx.dtype}")
    if idx.shape != (N,):
        raise ValueError(f"`initial_state_indices` must be [N={N}], got {list(idx.shape)}")
    v = inputs[1] if len(inputs) > 1 else None
    if isinstance(v, Tensor) and v.dim() == 4 and q.dim() == 4:  # (their own shapes are checked with the call)
        _require_pool_shape(x, v.shape[2], q.shape[3], v.shape[3], state_v_first)
    elif x.dim() != 4:
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        raise ValueError(f"`initial_state` (the state pool) must be 4-D {layout}, got {list(x.shape)}")
    if idx.device != x.device or x.device != q.device:
        _require_device("initial_state_indices", idx, q.device)
        _require_device("initial_state", x, q.device)
    # Any input that would train (grad mode on), as check_problem asks (only q and the pool were
    # asked until 2026-12-04: a v requiring grad gave a CPU pool autograd history).
    if torch.is_grad_enabled() and _any_requires_grad((x, q, *inputs)):
        raise ValueError("a prefill into a state pool (`initial_state_indices`) has no backward: call without grad")
    if not x.is_contiguous():
        raise ValueError("`initial_state` (the state pool) must be contiguous: it is updated in place")
    _require_pool_final_dtype(final_state_dtype, x, "`initial_state_indices`")
    return N, idx.contiguous()
