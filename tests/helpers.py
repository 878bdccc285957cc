"""Input generators and the fp64 yardstick shared by the tests."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import kda
import kda.cuda
from kda import reference
from kda.bench import FLA_OWN_KERNELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The backend that runs Triton's kernels through dispatch: auto on a GPU; on CPU tensors auto
# takes the torch backend (the interpreter is far slower), so the tests ask for Triton by name.
AUTO = "auto" if DEVICE == "cuda" else "triton"


@contextlib.contextmanager
def fla_itself():
    """fla's own KDA kernels inside the block (kda.bench.FLA_OWN_KERNELS), and nothing in it
    dispatched to kda: tests/test_fla.py registers kda in fla's dispatcher for the rest of its
    pytest worker, after which fla's chunk_kda runs kda, and a test "beside fla" compared kda with
    itself (run 177, 2026-12-06, where the bf16 gradient test's stand-in for kda.chunk_kda
    raised)."""
    with pytest.MonkeyPatch.context() as env, kda.record_dispatch() as events:
        for name, value in FLA_OWN_KERNELS.items():
            env.setenv(name, value)
        yield
    assert not events, f"a call to fla reached kda: {events}"


# GPU tests of the CUDA backend: skipped, with the reason, where its kernels are not built.
cuda_ready = pytest.mark.skipif(
    not torch.cuda.is_available() or kda.cuda._static_availability() is not None,
    reason=f"CUDA backend unavailable: {kda.cuda._static_availability() if torch.cuda.is_available() else 'no GPU'}",
)


@dataclasses.dataclass
class Case:
    """One random KDA problem; ``kwargs()`` gives the chunk_kda keyword arguments."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    gate: str  # "precomputed", "lower_bound", "softplus"
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    state_v_first: bool = False
    l2norm: bool = True

    def kwargs(self, **over) -> dict:
        kw = dict(
            initial_state=self.initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=self.l2norm,
            use_beta_sigmoid_in_kernel=True,
            state_v_first=self.state_v_first,
            cu_seqlens=self.cu_seqlens,
        )
        if self.gate != "precomputed":
            kw.update(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
        if self.gate == "lower_bound":
            kw.update(lower_bound=-5.0, safe_gate=True)
        kw.update(over)
        return kw

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta

    def to(self, dtype: torch.dtype | None = None, device=None) -> Case:
        """The same problem with q, k, v (and a float64 state for float64) in ``dtype``."""

        def cast(x, floating=True):
            if x is None:
                return None
            return x.to(device=device, dtype=dtype if floating else None)

        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return dataclasses.replace(
            self,
            q=cast(self.q),
            k=cast(self.k),
            v=cast(self.v),
            g=self.g.to(device=device, dtype=torch.float64 if dtype == torch.float64 else self.g.dtype),
            beta=self.beta.to(device=device, dtype=torch.float64 if dtype == torch.float64 else self.beta.dtype),
            initial_state=None if self.initial_state is None else self.initial_state.to(device, state_dtype),
            A_log=None if self.A_log is None else self.A_log.to(device, state_dtype),
            dt_bias=None if self.dt_bias is None else self.dt_bias.to(device, state_dtype),
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device),
        )


def make_case(
    seq_lens: list[int] | None = None,
    B: int = 1,
    T: int = 32,
    H: int = 2,
    HV: int | None = None,
    K: int = 32,
    V: int = 32,
    dtype: torch.dtype = torch.float32,
    gate: str = "lower_bound",
    state_v_first: bool = False,
    with_state: bool = True,
    device="cpu",
    seed: int | None = None,
    steep_steps: int = 0,
) -> Case:
    """Fresh random inputs (never zeros). ``seq_lens`` makes a varlen problem (B = 1).
    ``steep_steps`` sets that many random (t, channel) log-decays to -50 (precomputed gate)
    or gate inputs to huge values (softplus gate)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    HV = HV or H
    cu = None
    if seq_lens is not None:
        B, T = 1, sum(seq_lens)
        cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int64)
    N = B if cu is None else len(seq_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    if gate == "precomputed":
        g = -torch.rand(B, T, HV, K, generator=gen) * 1.5 - 0.01
        if steep_steps and T:
            idx = torch.randint(0, T, (steep_steps,), generator=gen)
            g[:, idx, :, : max(1, K // 2)] = -50.0
    else:
        g = randn(B, T, HV, K) * 2
        if steep_steps and T:
            idx = torch.randint(0, T, (steep_steps,), generator=gen)
            g[:, idx] = 40.0  # softplus(40) * exp(A_log) >= 40 per step
    case = Case(
        q=randn(B, T, H, K),
        k=randn(B, T, H, K),
        v=randn(B, T, HV, V),
        g=g,
        beta=randn(B, T, HV),
        initial_state=randn(N, HV, V, K) if state_v_first else randn(N, HV, K, V),
        gate=gate,
        A_log=torch.rand(HV, generator=gen) if gate != "precomputed" else None,
        dt_bias=torch.rand(HV * K, generator=gen) if gate != "precomputed" else None,
        cu_seqlens=cu,
        state_v_first=state_v_first,
    )
    if not with_state:
        case.initial_state = None
    return case.to(dtype, device)


def fp64_reference(case: Case, recurrent: bool = True, **over) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 token-by-token reference, on the CPU, in fla's layouts."""
    c64 = case.to(torch.float64, "cpu")
    fn = kda.fused_recurrent_kda if recurrent else kda.chunk_kda
    kw = c64.kwargs(**over)
    if recurrent:
        kw.pop("safe_gate", None)
    return fn(*c64.tensors(), backend="torch", **kw)


def fp64_direct(case: Case, scale: float | None = None, allow_neg_eigval: bool = False) -> tuple:
    """The float64 token loop from :mod:`kda.reference` itself, on the CPU, in fla's layouts:
    ``(o, final state)`` of ``case`` with this ``scale`` (None: K^-0.5, fla's default) and beta
    form. :func:`fp64_reference` is the torch backend behind the public API, so an argument the
    API loses on its way (a scale, a beta form) is lost from that yardstick too; this one takes
    them from the test, not from the API."""
    c = case.to(torch.float64, "cpu")
    HV, K = c.g.shape[-2:]
    gated = c.gate != "precomputed"
    q, k, g, beta = reference.activate_inputs(
        c.q, c.k, c.g, c.beta, use_qk_l2norm=c.l2norm, use_gate=gated, use_beta_sigmoid=True,
        allow_neg_eigval=allow_neg_eigval, A_log=c.A_log,
        dt_bias=None if c.dt_bias is None else c.dt_bias.view(HV, K),
        lower_bound=c.kwargs().get("lower_bound"),
    )  # fmt: skip
    h0 = c.initial_state
    if h0 is not None and c.state_v_first:
        h0 = h0.transpose(-1, -2)
    o, ht = reference.naive_recurrent_kda(
        q, k, c.v, g, beta, scale=K**-0.5 if scale is None else scale, initial_state=h0, output_final_state=True,
        cu_seqlens=c.cu_seqlens,
    )  # fmt: skip
    return o, ht.transpose(-1, -2) if c.state_v_first else ht


def recurrent_kwargs(case: Case, **over) -> dict:
    """``case``'s keyword arguments for fused_recurrent_kda (which takes no safe_gate)."""
    kw = case.kwargs(**over)
    kw.pop("safe_gate", None)
    return kw


def start_states(pool: torch.Tensor, slots, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The state each sequence starts from in a pool: its slot's, or zeros for no slot (negative
    or past the pool), in ``dtype`` (None: the pool's)."""
    P = pool.shape[0]
    states = torch.stack([pool[s] if 0 <= s < P else torch.zeros_like(pool[0]) for s in slots])
    return states if dtype is None else states.to(dtype)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return reference.relative_rms(x.cpu(), ref.cpu())


def assert_close_fp64(x: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    err = rel(x, ref)
    assert err <= tol, f"{what}: relative RMS {err:.3e} > {tol:.1e}"


def guarded(shape, dtype, device, guard=4096):
    """A NaN-poisoned view with poisoned guard regions before and after it."""
    n = torch.Size(shape).numel()
    buf = torch.full((n + 2 * guard,), float("nan"), dtype=dtype, device=device)
    return buf, buf[guard : guard + n].view(shape), guard


def assert_bands_untouched(buf: torch.Tensor, guard: int, what: str) -> None:
    """The NaN bands of a ``guarded`` buffer are still all NaN: no write landed outside ``what``."""
    assert buf[:guard].isnan().all() and buf[-guard:].isnan().all(), f"a write landed outside {what}"


def assert_checkpoints_close(ours: torch.Tensor, theirs: torch.Tensor, rows: int, tol: float = 1e-2) -> None:
    """Checkpoint rows ``[:rows]`` (``[rows, H, ., .]``) close row by row and head by head, so that
    one bad row is not averaged away (over a whole tensor the initial states' rows can carry
    nearly all the energy); a zero row must be matched exactly."""
    for r in range(rows):
        for h in range(ours.shape[1]):
            a, b = ours[r, h], theirs[r, h]
            assert (a == b).all() if b.abs().max() == 0 else rel(a, b) < tol, (r, h, rel(a, b))


def assert_strictly_causal(case: Case, backend: str, cuts: tuple[int, ...]) -> None:
    """Outputs before each cut t are bit-identical when k, v, g at t and later are redrawn."""
    o, _ = kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
    for t in cuts:
        changed = dataclasses.replace(case, k=case.k.clone(), v=case.v.clone(), g=case.g.clone())
        for x in (changed.k, changed.v, changed.g):
            x[:, t:] = torch.randn_like(x[:, t:])
        o2, _ = kda.chunk_kda(*changed.tensors(), backend=backend, **changed.kwargs())
        assert torch.equal(o[:, :t], o2[:, :t]), f"{backend}: outputs before {t} moved"


def assert_graph_replays_eager(case: Case, backend: str) -> None:
    """After one eager call (compiles, tunes, caches the chunk tables) the call can be
    captured in a CUDA graph, and a replay gives the eager output bit for bit."""
    kw = case.kwargs()
    if kw.get("cu_seqlens") is not None:  # a capture cannot copy cu_seqlens to the host
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    eager, _ = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager), f"{backend}: graph replay differs from the eager call"


GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def gradients(
    case: Case,
    backend: str,
    recurrent: bool = False,
    seed: int = 0,
    final_state_grad: bool = True,
    train: tuple[str, ...] = GRAD_INPUTS,
    outputs: bool = False,
    **over,
) -> dict[str, torch.Tensor]:
    """The gradients of ``sum(o * do) + sum(final_state * dht)`` with respect to the tensor
    inputs of ``case`` named in ``train`` (default every one of GRAD_INPUTS that is present; the
    others are passed as tensors that do not require grad), computed by ``backend``; ``do`` and
    ``dht`` are random, drawn from ``seed`` on the CPU (the same for every backend and dtype).
    ``final_state_grad=False`` leaves the final state out of the loss; ``outputs=True`` adds the
    call's own ``"o"`` and ``"ht"`` (detached) to the gradients."""
    inputs = {name: getattr(case, name) for name in GRAD_INPUTS if getattr(case, name) is not None}
    inputs = {name: x.detach().clone().requires_grad_(name in train) for name, x in inputs.items()}
    leaves = {name: x for name, x in inputs.items() if name in train}
    kw = case.kwargs(**over)
    kw.update({name: inputs[name] for name in ("initial_state", "A_log", "dt_bias") if name in inputs})
    fn = kda.fused_recurrent_kda if recurrent else kda.chunk_kda
    if recurrent:
        kw.pop("safe_gate", None)
    o, ht = fn(*(inputs[name] for name in ("q", "k", "v", "g", "beta")), backend=backend, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
    loss = (o * do).sum()
    if final_state_grad and ht is not None:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device, ht.dtype)
        loss = loss + (ht * dht).sum()
    if not leaves:
        return {}
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    if outputs:
        return {"o": o.detach(), "ht": ht.detach(), **dict(zip(leaves, grads))}
    return dict(zip(leaves, grads))


def fp64_gradients(case: Case, **kw) -> dict[str, torch.Tensor]:
    """:func:`gradients` by float64 autograd of the token loop, on the CPU: the yardstick."""
    return gradients(case.to(torch.float64, "cpu"), "torch", recurrent=True, **kw)
