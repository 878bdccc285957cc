"""The Triton backend against the float64 reference: accuracy, full writes, no stray
writes, the fast path really running. Small shapes under the interpreter on CPU; the
``gpu`` tests run real sizes on a GPU."""

import importlib.util
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda
from helpers import (
    AUTO,
    DEVICE,
    assert_bands_untouched,
    assert_close_fp64,
    assert_graph_replays_eager,
    assert_strictly_causal,
    cuda_ready,
    fla_itself,
    fp64_reference,
    guarded,
    make_case,
    recurrent_kwargs,
    rel,
)
from kda import dispatch
from kda.api import checked_problem
from kda.triton import run_stages

ON_GPU = DEVICE == "cuda"
# The interpreter rounds float32 -> bf16/fp16 by truncation, about twice the error of the
# GPU's round-to-nearest at each of the 16-bit roundings (workspace, state-product operands,
# output); seen up to 1.04e-2 on tiny CPU shapes. The spec's 5e-3 bar applies on the GPU,
# where the same kernels measure about 3e-3 (benchmarks/results/).
BAR = {torch.float32: 1e-4, torch.bfloat16: 5e-3 if ON_GPU else 2e-2, torch.float16: 5e-3 if ON_GPU else 2e-2}
GATES = ("precomputed", "lower_bound", "softplus")


@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    gate=st.sampled_from(GATES),
    K=st.sampled_from([16, 24, 32]),
    V=st.sampled_from([8, 20, 32]),
    group=st.sampled_from([1, 2]),
    layout=st.booleans(),
    seed=st.integers(0, 9999),
)
def test_triton_matches_fp64(lens, dtype, gate, K, V, group, layout, seed):
    case = make_case(
        seq_lens=lens, H=1, HV=group, K=K, V=V, dtype=dtype, gate=gate,
        state_v_first=layout, device=DEVICE, seed=seed, steep_steps=1,
    )  # fmt: skip
    o, ht = kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs())
    o_ref, ht_ref = fp64_reference(case)
    assert o.dtype == case.q.dtype and ht.dtype == torch.float32
    assert_close_fp64(o, o_ref, BAR[dtype], "o")
    assert_close_fp64(ht, ht_ref, BAR[dtype], "final state")


@pytest.mark.parametrize("gate", GATES)
def test_steep_decay_exact(gate):
    """Per-step log-decay of -50 (the unbounded gate's range) stays finite and float32-exact."""
    case = make_case(T=48, H=1, K=16, V=16, gate=gate, device=DEVICE, seed=5, steep_steps=5)
    o, ht = kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs())
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 1e-4, "o")
    assert_close_fp64(ht, ht_ref, 1e-4, "final state")


@pytest.mark.parametrize("layout", [False, True])
def test_poisoned_outputs_fully_written_and_nothing_outside(layout):
    case = make_case(seq_lens=[0, 17, 1, 33], H=2, HV=4, K=32, V=24, dtype=torch.bfloat16,
                     state_v_first=layout, device=DEVICE, seed=7)  # fmt: skip
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    o_buf, o, og = guarded((1, p.T, p.HV, p.V), torch.bfloat16, DEVICE)
    state_shape = (p.N, p.HV, p.V, p.K) if layout else (p.N, p.HV, p.K, p.V)
    h_buf, ht, hg = guarded(state_shape, torch.float32, DEVICE)
    run_stages(p, o, ht)
    assert not o.isnan().any(), "some output elements were never written"
    assert not ht.isnan().any(), "some final-state elements were never written"
    for buf, g in ((o_buf, og), (h_buf, hg)):
        assert_bands_untouched(buf, g, "the output")
    o_ref, ht_ref = fp64_reference(case)
    assert rel(o, o_ref) <= BAR[torch.bfloat16] and rel(ht, ht_ref) <= BAR[torch.bfloat16]


def test_auto_runs_the_triton_kernels_where_they_apply():
    """On a GPU auto picks Triton (on CPU tensors the interpreter is asked for by name), and
    both kernels really launch."""
    case = make_case(T=20, H=1, K=16, V=16, device=DEVICE, seed=8)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), backend=AUTO, **case.kwargs())
    assert events == ["chunk_kda -> triton", "triton:prepare_chunks", "triton:recurrence_v_split"]


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors: where no GPU is visible")
def test_auto_prefers_torch_to_the_interpreter_on_cpu_tensors(caplog):
    """Under TRITON_INTERPRET=1 the Triton backend can run CPU tensors, but auto takes the
    (far faster) torch backend and says why."""
    import logging

    from kda import dispatch

    case = make_case(T=20, H=1, K=16, V=16, seed=8)
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="kda"), kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert events == ["chunk_kda -> torch"]
    assert any(r.getMessage().startswith("[kda] chunk_kda: triton rejected: tensors on cpu: the Triton interpreter")
               for r in caplog.records), [r.getMessage() for r in caplog.records]  # fmt: skip


def test_fused_recurrent_on_triton_equals_chunk():
    """Sequences past the decode kernel's range run the chunk stages (a chunk may be short)."""
    case = make_case(seq_lens=[1, 1, 3, 0, dispatch.RECURRENT_DECODE_TOKENS + 2], H=2, K=16, V=16, device=DEVICE,
                     seed=9)  # fmt: skip
    kw = case.kwargs()
    kw.pop("safe_gate", None)
    with kda.record_dispatch() as events:
        o, ht = kda.fused_recurrent_kda(*case.tensors(), backend="triton", **kw)
    assert "triton:recurrence_v_split" in events
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 1e-4, "o")
    assert_close_fp64(ht, ht_ref, 1e-4, "state")


def test_prefill_then_decode_equals_one_prefill():
    """The layout contract end to end: chunk_kda's final state feeds fused_recurrent_kda."""
    case = make_case(T=40, H=2, K=16, V=16, state_v_first=True, device=DEVICE, seed=10)
    o, ht = kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs())
    pre = type(case)(**case.__dict__)
    pre.q, pre.k, pre.v, pre.g, pre.beta = (x[:, :37] for x in case.tensors())
    _, h_pre = kda.chunk_kda(*pre.tensors(), backend="triton", **pre.kwargs())
    outs = []
    state = h_pre
    for t in range(37, 40):
        step = [x[:, t : t + 1] for x in case.tensors()]
        kw = case.kwargs(initial_state=state)
        kw.pop("safe_gate", None)
        o_t, state = kda.fused_recurrent_kda(*step, backend="triton", **kw)
        outs.append(o_t)
    assert rel(torch.cat(outs, 1), o[:, 37:]) <= 1e-5
    assert rel(state, ht) <= 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
def test_bfloat16_states_in_and_out(backend, op):
    """kda's extension of fla's API: a bf16 initial state is read (and carried in float32), and
    final_state_dtype=torch.bfloat16 returns the final state in bf16, within bf16 rounding of
    the float64 reference run from the same (bf16-valued) initial state. Both ops through their
    public functions (fused_recurrent_kda's sequences in the decode kernel's range; a mutation
    audit of 2026-12-05 found its final_state_dtype dropped passing: only chunk_kda was asked)."""
    case = make_case(seq_lens=[20, 7], H=2, K=16, V=16, dtype=torch.bfloat16, state_v_first=True,
                     device=DEVICE, seed=13)  # fmt: skip
    case.initial_state = case.initial_state.to(torch.bfloat16)
    kw = case.kwargs()
    if op == "fused_recurrent_kda":
        kw.pop("safe_gate")
    o, ht = getattr(kda, op)(*case.tensors(), backend=backend, final_state_dtype=torch.bfloat16, **kw)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.bfloat16
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, BAR[torch.bfloat16], "o")
    assert_close_fp64(ht, ht_ref, BAR[torch.bfloat16], "final state")
    _, ht32 = getattr(kda, op)(*case.tensors(), backend=backend, **kw)
    assert ht32.dtype == torch.float32 and rel(ht, ht32) <= 2**-8  # the same state, rounded to bf16


# ----------------------------------------------------------------------------- GPU only

fla_available = importlib.util.find_spec("fla") is not None


@pytest.mark.gpu
@given(
    T=st.integers(1, 8192),
    H=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    gate=st.sampled_from(GATES),
    D=st.sampled_from([64, 100, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gpu_triton_matches_fp64_large(T, H, dtype, gate, D, seed):
    case = make_case(T=T, H=H, K=D, V=D, dtype=dtype, gate=gate, device="cuda", seed=seed, state_v_first=True)
    o, ht = kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs())
    c64 = case.to(torch.float64)
    o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), backend="torch", **c64.kwargs())
    assert_close_fp64(o, o_ref, BAR[dtype], "o")
    assert_close_fp64(ht, ht_ref, BAR[dtype], "final state")


@pytest.mark.gpu
@pytest.mark.skipif(not fla_available, reason="fla (flash-linear-attention) is not installed")
@pytest.mark.parametrize("lens", [[1024], [512, 300, 777]])
def test_gpu_no_worse_than_fla(lens):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    case = make_case(seq_lens=lens, H=8, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=12)
    kw = case.kwargs()
    o, ht = kda.chunk_kda(*case.tensors(), backend="triton", **kw)
    with torch.inference_mode(), fla_itself():
        o_fla, ht_fla = fla_chunk_kda(*case.tensors(), **kw)
    c64 = case.to(torch.float64)
    o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), backend="torch", **c64.kwargs())
    print(
        f"kda o {rel(o, o_ref):.3e} state {rel(ht, ht_ref):.3e}; "
        f"fla o {rel(o_fla, o_ref):.3e} state {rel(ht_fla, ht_ref):.3e}"
    )
    assert rel(o, o_ref) <= 1.1 * rel(o_fla, o_ref)
    assert rel(ht, ht_ref) <= 1.1 * rel(ht_fla, ht_ref)


@pytest.mark.gpu
def test_gpu_torch_backend_matches_cpu():
    case = make_case(seq_lens=[19, 0, 40], H=2, HV=4, K=32, V=16, gate="softplus", seed=13)
    o_cpu, ht_cpu = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
    gpu = case.to(torch.float32, "cuda")
    o_gpu, ht_gpu = kda.chunk_kda(*gpu.tensors(), backend="torch", **gpu.kwargs())
    assert rel(o_gpu, o_cpu) <= 1e-5 and rel(ht_gpu, ht_cpu) <= 1e-5


@pytest.mark.gpu
def test_gpu_triton_graph_capture_replays_the_eager_result():
    case = make_case(seq_lens=[1000, 37], H=4, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=15)
    assert_graph_replays_eager(case, "triton")


@pytest.mark.gpu
def test_gpu_long_strict_causality():
    case = make_case(T=4099, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=14)
    assert_strictly_causal(case, "triton", (4097, 4000, 17))


def test_kernels_compile_for_hopper():
    """Compile the forward, backward, table and decode kernels for sm_90 with Triton's own
    toolchain; needs no GPU, so CI catches what the interpreter lets through (e.g.
    non-constexpr globals, run 12 on the H200, 2026-12-01). Runs in a
    child process: kernels defined under TRITON_INTERPRET=1 cannot be compiled."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_hopper.py")
    res = subprocess.run([sys.executable, str(script), "--ptxas=chunk_input_grads_kernel"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    # 8 prepare, 6 recurrence, 4 state-gradient chain, 4 + 2 + 5 local-gradient (the state and dU
    # kernels on the Triton and K1 workspaces), 3 table, 3 decode variants, the split's chain
    assert res.stdout.count("compiled") == 36, res.stdout
    # The unsafe gates' first launch (prepare.FAR_LAUNCHES) must compile like the safe gate's
    # kernel: with the pairwise path inline, ptxas gave it 64 registers and 8 KB of spill code.
    lines = res.stdout.splitlines()
    figures = {}
    for line, stats in zip(lines, lines[1:]):
        if line.startswith("compiled chunk_input_grads_kernel") and "'PAIRWISE': False" in line:
            regs, spills = (int(x) for x in re.search(r"registers (\d+), .* spill stores (\d+) B", stats).groups())
            figures["safe" if "'SAFE': True" in line else line] = regs, spills
    safe_regs, safe_spills = figures.pop("safe")
    assert len(figures) == 2, res.stdout
    for line, (regs, spills) in figures.items():
        assert regs >= safe_regs - 32 and spills <= 2 * safe_spills + 512, (line, regs, spills, safe_regs, safe_spills)


def test_autotune_prunes_configs_that_would_spill():
    """A state slice over 128 float32 registers per thread is never tuned (it spills and
    compiles for minutes); at least one config always survives."""
    import triton

    from kda.triton.recurrence import _fits_in_registers

    configs = [triton.Config({"BV": bv}, num_warps=nw) for bv, nw in ((16, 1), (64, 1), (64, 2), (32, 4))]
    kept = [(c.kwargs["BV"], c.num_warps) for c in _fits_in_registers(configs, {}, BK=128)]
    assert kept == [(16, 1), (64, 2), (32, 4)]
    assert len(_fits_in_registers(configs[1:2], {}, BK=256)) == 1


@pytest.mark.parametrize(
    "gate, value",
    [("precomputed", float("-inf")), ("precomputed", -1e30), ("precomputed", -300.0), ("softplus", float("inf")),
     ("softplus", 1e30)],
)  # fmt: skip
def test_hard_resets_are_exact(gate, value):
    """A log-decay of -inf (or below reference.HARD_RESET; the softplus gate of an infinite or
    huge input) zeroes its key channel exactly: float32-exact against the float64 token loop,
    finite, on Triton and the torch chunk form. Resets on a chunk's first and last rows, twice
    in a chunk, in every channel of one row, in a second sequence."""
    case = make_case(seq_lens=[40, 7, 16], H=1, HV=2, K=16, V=16, gate=gate, device=DEVICE, seed=51)
    for t, hv, channels in ((0, 0, [0]), (5, 1, [1, 2]), (9, 0, [1]), (15, 0, [3]), (16, 1, [3]),
                            (17, 0, list(range(16))), (44, 1, [5]), (47, 0, [2]), (62, 1, [6])):  # fmt: skip
        case.g[0, t, hv, channels] = value
    o_ref, ht_ref = fp64_reference(case)
    assert torch.isfinite(o_ref).all() and torch.isfinite(ht_ref).all()
    for backend in ("triton", "torch"):
        o, ht = kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
        assert_close_fp64(o, o_ref, 1e-4, f"{backend} o")
        assert_close_fp64(ht, ht_ref, 1e-4, f"{backend} final state")


@pytest.mark.gpu
def test_gpu_chunk_chains_of_more_than_65535_sequence_heads():
    """2100 sequences x 32 value heads through the chunk stages, forward and backward (their
    chains run on a one-dimensional grid: a second dimension stops at 65535): the first and
    last sequences' outputs and gradients equal those of a call on them alone."""
    lens = [3 + n % 5 for n in range(2100)]
    case = make_case(seq_lens=lens, H=32, K=16, V=16, with_state=False, device="cuda", seed=89)
    picked = list(range(20)) + list(range(len(lens) - 20, len(lens)))
    cu = case.cu_seqlens.tolist()
    rows = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in picked]).cuda()
    small = make_case(seq_lens=[lens[n] for n in picked], H=32, K=16, V=16, with_state=False, device="cuda", seed=0)
    for name in ("q", "k", "v", "g", "beta"):
        setattr(small, name, getattr(case, name)[:, rows].contiguous())
    small.A_log, small.dt_bias = case.A_log, case.dt_bias
    do = torch.randn(case.v.shape, generator=torch.Generator().manual_seed(5)).cuda()

    def run(c, do):
        leaves = [x.detach().clone().requires_grad_() for x in c.tensors()]
        with kda.record_dispatch() as events:
            o, _ = kda.chunk_kda(*leaves, backend="triton", **c.kwargs(output_final_state=False))
            (o * do).sum().backward()
        return o, [x.grad for x in leaves], events

    o, grads, events = run(case, do)
    assert "triton:recurrence_v_split" in events and "triton:state_grad_chain" in events, events
    o1, grads1, _ = run(small, do[:, rows].contiguous())
    # (equal up to rounding: the two calls may be tuned to other V slices)
    assert rel(o[:, rows], o1) <= 1e-5
    for g, g1 in zip(grads, grads1):
        assert rel(g[:, rows], g1) <= 1e-5


INTERPRETER_UNDER_TRACER = """
import sys
import torch, kda
q, k, v = (torch.randn(1, 20, 1, 16) for _ in range(3))
g, b = -torch.rand(1, 20, 1, 16), torch.rand(1, 20, 1)
f = lambda q, k, v, g, b: kda.chunk_kda(q, k, v, g, b, backend="triton")[0]
try:  # the process's first Triton call, under a transform or a tracer
    if sys.argv[1] == "func_grad":  # (torch refuses the custom op there)
        torch.func.grad(lambda q: f(q, k, v, g, b).sum())(q)
    elif sys.argv[1] == "meta":  # (a function mode: auto asks the Triton backend whether it runs)
        with torch.device("meta"):
            kda.chunk_kda(q, k, v, g, b)
    elif sys.argv[1] == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            f(*(mode.from_tensor(x) for x in (q, k, v, g, b)))
    else:
        from torch.fx.experimental.proxy_tensor import make_fx
        make_fx(f, tracing_mode="fake")(q, k, v, g, b)
except Exception as e:
    print("under the tracer:", type(e).__name__)
kda.chunk_kda(q, k, v, g, b, backend="triton")
print("triton ran")
"""


@pytest.mark.parametrize("tracer", ["func_grad", "meta", "fake", "make_fx"])
def test_interpreter_probe_first_run_under_a_tracer_does_not_turn_triton_off(tracer):
    """The interpreter's probe (triton.common.interpreter_fault, cached for the process) run first
    under torch.func.grad saw wrapped tensors, under FakeTensorMode or make_fx fake tensors, and in
    a torch.device("meta") block meta tensors, and cached a false NumPy fault, turning the Triton
    backend off for the rest of the process (three reviews of 2026-12-07). A fresh process, since
    the answer is cached."""
    import subprocess
    import sys

    from kda.triton.common import interpreting

    if not interpreting():
        pytest.skip("the probe runs under the CPU interpreter only (TRITON_INTERPRET=1)")
    run = subprocess.run([sys.executable, "-c", INTERPRETER_UNDER_TRACER, tracer], capture_output=True, text=True,
                         timeout=300, env=os.environ | {"TRITON_INTERPRET": "1"})  # fmt: skip
    assert "triton ran" in run.stdout, run.stdout + run.stderr[-2000:]
    if tracer != "func_grad":  # (torch.func refuses the kernels by name; the others run the call)
        assert "under the tracer" not in run.stdout, run.stdout


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("backend", [AUTO, pytest.param("cuda", marks=[pytest.mark.gpu, cuda_ready])])
def test_tracers_see_the_custom_op_without_grad(op, backend):
    """Without grad the Triton backend launched its kernels directly: on fake tensors
    (FakeTensorMode, make_fx's fake tracing) they read storage that is not there, and make_fx's
    real tracing ran them unseen, leaving them out of the graph (a review of 2026-12-07). Under
    any dispatch mode the call now goes through kda::chunk_fwd (decode shapes included), whose
    fake gives the shapes; the traced graph holds it and replays the eager call's numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    T = 3 if op == "fused_recurrent_kda" else 20  # (decode shapes: the decode kernel's route)
    if backend == "cuda":  # (the CUDA kernels' scope: bf16, K = V = 128)
        case = make_case(B=2, T=T, H=1, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=91)
    else:
        case = make_case(B=2, T=T, H=1, K=16, V=16, device=DEVICE, seed=91)
    kw = case.kwargs() if op == "chunk_kda" else recurrent_kwargs(case)
    names = ("initial_state", "A_log", "dt_bias")

    def f(q, k, v, g, beta, *state_and_gate):
        return getattr(kda, op)(q, k, v, g, beta, backend=backend, **dict(kw, **dict(zip(names, state_and_gate))))

    tensors = (*case.tensors(), *(kw[name] for name in names))
    want = f(*tensors)
    with FakeTensorMode() as mode:
        fake = f(*(mode.from_tensor(x) for x in tensors))
    assert [x.shape for x in fake] == [x.shape for x in want]
    for tracing_mode in ("fake", "real"):
        graph = make_fx(f, tracing_mode=tracing_mode)(*tensors)
        assert "kda.chunk_fwd" in str(graph.graph), graph.graph
        for got, ref in zip(graph(*tensors), want):
            if backend == "cuda":  # (the graph's op runs the chunk kernels, eager a decode's may run the decode kernel)
                assert rel(got.float(), ref.float()) <= 1e-2, rel(got.float(), ref.float())
            else:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_state_pools_under_a_dispatch_mode_run_on_torch_ops():
    """The decode kernel writes a pool in place, which a dispatch mode cannot see (make_fx left it out
    of the graph) and fake tensors cannot hold (a raw error): under one, the kernel backends pass the
    pool over (auto takes the torch backend, whose ops are traced; triton by name is refused saying
    why; a review, 2026-12-07)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    case = make_case(B=2, T=1, H=1, HV=2, K=16, V=16, device=DEVICE, seed=93)
    pool = torch.randn(4, 2, 16, 16, generator=torch.Generator().manual_seed(94)).to(DEVICE)
    slots = torch.tensor([3, 1], device=DEVICE)

    def f(backend, q, k, v, g, beta, A_log, dt_bias, pool, slots):
        kw = recurrent_kwargs(case, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots)
        kw.update(A_log=A_log, dt_bias=dt_bias)
        return kda.fused_recurrent_kda(q, k, v, g, beta, backend=backend, **kw)[0]

    inputs = (*case.tensors(), case.A_log, case.dt_bias)
    with FakeTensorMode() as mode, pytest.raises(kda.BackendUnavailableError, match="pool under a dispatch mode"):
        f("triton", *(mode.from_tensor(x) for x in (*inputs, pool, slots)))
    want_pool = pool.clone()
    want = f("auto", *inputs, want_pool, slots)
    graph = make_fx(lambda *t: f("auto", *t), tracing_mode="real")(*inputs, pool.clone(), slots)
    assert "aten" in str(graph.graph) and "decode" not in str(graph.graph)
    replayed = pool.clone()
    got = graph(*inputs, replayed, slots)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(replayed, want_pool, rtol=1e-4, atol=1e-5)
    assert not torch.equal(replayed, pool), "the replay did not write the pool"
