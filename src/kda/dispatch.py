"""Backend registry and choice: which implementation runs a checked :class:`Problem`.

Every backend says whether it is available at all (``availability``) and whether it
supports a given call (``rejects``), each with a reason. ``backend="auto"`` takes the first
of ``AUTO_ORDER`` that accepts the call and has no reason to be passed over
(``auto_rejects``). Every decision, and every refusal with its reason, is logged once per
process on the ``kda`` logger, and can be captured with :func:`record_dispatch` (tests use
it to prove that a fast path really ran).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from kda.validation import Problem

logger = logging.getLogger("kda")

AUTO_ORDER = ("cuda", "triton", "torch")
BACKEND_MODULES = {"cuda": "kda.cuda", "triton": "kda.triton", "torch": "kda.torch_backend"}


class Backend(Protocol):
    name: str
    # What a call with grad runs where, for the dispatch log: "forward and backward" (one
    # backend both ways), or the CUDA backend's split (its forward, Triton's backward).
    training: str

    def availability(self) -> str | None:
        """None when the backend can run on this machine, else why not."""

    def rejects(self, problem: Problem) -> str | None:
        """None when the backend supports this call, else the unsupported feature."""

    def auto_rejects(self, problem: Problem) -> str | None:
        """None, or why ``auto`` should pass over a call the backend could run when asked by
        name (the Triton interpreter on CPU tensors: the torch backend is far faster)."""

    def run(self, problem: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, final_state)`` with fla's shapes, dtypes and state layout."""


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str


class BackendUnavailableError(RuntimeError):
    """Raised when an explicitly requested backend cannot run the call; says why."""


_backends: dict[str, Backend] = {}
_logged: set[str] = set()
_recorders: list[list[str]] = []
_lock = threading.Lock()


# The longest sequence (tokens) a call without grad may have for the one-launch decode
# kernel (kda.triton.decode) to run it instead of the chunk stages. Measured on an H200
# (2026-12-01, benchmarks/results/h200-2026-12-01-decode.json, N=32, H=32, graph replay):
# chunk_kda: one token 0.046 ms against 0.074 for the CUDA chunk path, two a tie (0.077 /
# 0.075), the token loop loses from there (16 tokens: 0.334 / 0.080). fused_recurrent_kda
# keeps the token loop over fla's decode range (1 to 64 tokens: decode steps, speculative
# drafts): the chunk path's bf16 operands would cost the recurrent form's accuracy (N=32,
# 4 tokens: final state 2.3e-3 from fp64 on the chunk path, 8.6e-8 on the decode kernel,
# fla's 9.2e-8). State pools take the decode kernel at any length.
CHUNK_DECODE_TOKENS = 2
RECURRENT_DECODE_TOKENS = 64


def prefers_decode(p: Problem) -> bool:
    """Whether a call without grad should run on the decode kernel: its sequences are short
    enough that one launch walking the tokens beats the prepare and recurrence stages (or,
    for fused_recurrent_kda, keeps the token loop's accuracy). Never for calls that go through
    the custom op (:func:`through_op`)."""
    if through_op(p):
        return False
    limit = RECURRENT_DECODE_TOKENS if p.op == "fused_recurrent_kda" else CHUNK_DECODE_TOKENS
    if p.N * limit < p.T:  # the mean passes the limit, so does the longest: no need to find it
        return False
    # Lengths never copied to the host (validation.CHECK_CU_SEQLENS) are routed by the mean,
    # which a decode step (a few tokens for every sequence) is judged by as well: it is in range.
    return p.lengths_unchecked or p.longest <= limit


# What torch.cuda.current_device returns once CUDA is initialised (as it is with CUDA inputs),
# without its initialisation check: 0.1 us a call less. Absent from CPU-only builds.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_STAY = contextlib.nullcontext()  # holds nothing: one serves every call and thread


def on_device(device_index: int) -> contextlib.AbstractContextManager:
    """Make ``device_index`` torch's current device: Triton launches on the current device's
    current stream, and the CUDA path's driver calls use its primary context. When it already
    is, torch.cuda.device would not switch anything either (torch skips cudaSetDevice for the
    current device); skipping it saves its Python cost."""
    current = torch.cuda.current_device() if _current_device is None else _current_device()
    if current == device_index:
        return _STAY
    return torch.cuda.device(device_index)


def on_device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """:func:`on_device` for the GPU that holds ``x``; nothing for a CPU tensor."""
    return on_device(x.get_device()) if x.is_cuda else _STAY


def stream_capturing(device_index: int) -> bool:
    """Whether the current stream of ``device_index`` (not of the current device, which torch's
    query asks about) is being captured into a CUDA graph."""
    with on_device(device_index):
        return torch.cuda.is_current_stream_capturing()


def capturing(x: torch.Tensor) -> bool:
    """Whether the stream of the GPU that holds ``x`` is being captured into a CUDA graph."""
    return x.is_cuda and stream_capturing(x.get_device())


def get_backend(name: str) -> Backend:
    if name not in BACKEND_MODULES:
        raise ValueError(f"`backend` must be one of 'auto', {', '.join(map(repr, BACKEND_MODULES))}; got {name!r}")
    if name not in _backends:
        _backends[name] = importlib.import_module(BACKEND_MODULES[name]).BACKEND
    return _backends[name]


def backends() -> list[BackendInfo]:
    """Every backend, whether it can run on this machine, and why (not)."""
    infos = []
    for name in AUTO_ORDER:
        reason = get_backend(name).availability()
        infos.append(BackendInfo(name, reason is None, reason or "ready"))
    return infos


def log_once(message: str) -> None:
    if message in _logged:  # every call after the first; a set lookup is atomic under the GIL
        return
    with _lock:
        if message in _logged:
            return
        _logged.add(message)
    logger.info("[kda] %s", message)


def note(event: str) -> None:
    """Append an event (a dispatch decision or a kernel launch) to active recorders."""
    for events in _recorders:
        events.append(event)


@contextlib.contextmanager
def record_dispatch() -> Iterator[list[str]]:
    """Collect ``"chunk_kda -> triton"`` decisions and ``"triton:<kernel>"`` launches."""
    events: list[str] = []
    _recorders.append(events)
    try:
        yield events
    finally:
        _recorders.remove(events)


def _traced_availability(name: str) -> str:
    """:meth:`Backend.availability` ("" when available) for a call that torch.compile traces:
    run once at trace time and taken as a constant, because the checks import modules and read
    files, which dynamo does not trace."""
    return get_backend(name).availability() or ""


# torch.compiler.assume_constant_result(fn) sets this attribute on fn and does nothing else
# (torch 2.4 to 2.13); set here, it spares `import kda` an import of torch._dynamo, which
# imports Triton before a caller (kda's CLI) may have set TRITON_INTERPRET. Tested: a
# torch.compile(fullgraph=True) of a model calling kda would fail on a graph break without it.
_traced_availability._dynamo_marked_constant = True


def refusal(backend: Backend, problem: Problem) -> str | None:
    if torch.compiler.is_compiling():
        return _traced_availability(backend.name) or backend.rejects(problem)
    return backend.availability() or backend.rejects(problem)


_TRANSFORMED_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "pool")


def transformed(problem: Problem) -> str | None:
    """Why only the torch backend can run ``problem``: an input is a forward-mode AD dual tensor
    (the kernels have no forward formula: a review of 2026-12-07 found the Triton path dropping
    the tangent without a word) or a torch.func transform's wrapper (the kernels read raw
    storage). None outside such transforms, after two checks of about 0.1 us."""
    dual = forward_ad._current_level >= 0
    if not dual and not torch._C._are_functorch_transforms_active():
        return None
    for name in _TRANSFORMED_INPUTS:
        x = getattr(problem, name)
        if x is None:
            continue
        if torch._C._functorch.is_batchedtensor(x):
            raise ValueError(f"`{name}` is batched by torch.func.vmap, which kda does not support on any backend: "
                             "batch the calls along B or with cu_seqlens instead")  # fmt: skip
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return (
                f"`{name}` is a torch.func transform's tensor: only backend='torch' runs under grad, jvp and the like"
            )
        if dual and forward_ad.unpack_dual(x).tangent is not None:
            return f"`{name}` is a forward-mode AD dual tensor: the kernels have no forward formula (backend='torch')"
    return None


# Why the kernel backends pass over a state pool under a dispatch mode or on tensor subclasses: the
# decode kernel writes the pool in place, unseen by the mode and with no fake to stand for it (the
# torch backend's ops are seen; found by a review, 2026-12-07).
POOL_TRACED = "a state pool under a dispatch mode (FakeTensorMode, make_fx, ...) or on tensor subclasses"


def through_op(problem: Problem) -> bool:
    """Whether a kernel backend runs ``problem`` through its custom op (kda.autograd) rather than
    launching directly: with grad (the op has the backward), under torch.compile (an opaque
    node), and on fake tensors or under a dispatch mode (FakeTensorMode, make_fx, a flop counter):
    the op's fake gives the shapes and the tracer sees the op, where a launch read storage that
    fake tensors do not have, or ran unseen by the tracer (a review of 2026-12-07)."""
    return problem.requires_grad or torch.compiler.is_compiling() or traced(problem)


def traced(problem: Problem) -> bool:
    """Whether a dispatch mode is active (FakeTensorMode, make_fx, a flop counter) or the inputs are
    tensor subclasses (fake tensors): a kernel launched directly would go unseen, or find no data."""
    return is_in_torch_dispatch_mode() or type(problem.q) is not torch.Tensor


def select(problem: Problem, requested: str) -> Backend:
    """The backend that runs ``problem``; raises if an explicit choice cannot. A call whose
    inputs require grad needs a backward: a backend without one rejects it, saying so; a call
    under an autograd transform the kernels cannot follow (:func:`transformed`) runs on torch."""
    compiling = torch.compiler.is_compiling()
    only_torch = None if compiling else transformed(problem)
    if compiling:  # the backends' modules are imported here, at trace time, outside the graph
        for name in AUTO_ORDER if requested == "auto" else (requested,):
            _traced_availability(name)
    if requested != "auto":
        backend = _backends.get(requested) or get_backend(requested)  # get_backend: the first call, or a bad name
        reason = refusal(backend, problem) or (only_torch if requested != "torch" else None)
        if reason is not None:
            raise BackendUnavailableError(f"backend={requested!r} cannot run {problem.describe()}: {reason}")
        chosen = backend
    else:
        chosen = None
        for name in AUTO_ORDER:
            backend = _backends.get(name) or get_backend(name)
            reason = refusal(backend, problem) or backend.auto_rejects(problem)
            if reason is None and name != "torch":
                reason = only_torch
            if reason is None:
                chosen = backend
                break
            if not compiling:
                log_once(f"{problem.op}: {name} rejected: {reason}")
        assert chosen is not None, "the torch backend accepts every checked problem"
    if not compiling:  # a traced call logs nothing here; its kernels note themselves when they run
        decision = f"{problem.op} -> {chosen.name}" + (f" ({chosen.training})" if problem.requires_grad else "")
        log_once(decision)
        note(decision)
    return chosen
