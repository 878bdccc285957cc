"""Backend reporting, dispatch decisions and their log lines, the CLI."""

import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import kda
from helpers import DEVICE, assert_close_fp64, fp64_direct, make_case, rel
from kda import dispatch

# Why the cuda backend is off on a machine without a GPU, depending on what was installed.
NO_CUDA_HERE = "not built|cuda-bindings is not installed|no CUDA GPU"


def test_backends_report_every_backend_with_reason():
    infos = {b.name: b for b in kda.backends()}
    assert set(infos) == {"cuda", "triton", "torch"}
    assert infos["torch"].available
    for b in infos.values():
        assert b.reason, f"{b.name} gives no reason"
    if not torch.cuda.is_available():
        assert not infos["cuda"].available
        assert re.search(NO_CUDA_HERE, infos["cuda"].reason), infos["cuda"].reason


def test_explicit_unavailable_backend_says_why():
    """A float32 CPU call to the cuda backend: refused with the reason, on any machine (without
    a GPU the backend is unavailable; with one, the kernels take bfloat16)."""
    case = make_case(T=8, H=1, K=16, V=16, seed=0)
    with pytest.raises(kda.BackendUnavailableError, match="cuda.*(" + NO_CUDA_HERE + "|dtype torch.float32)"):
        kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())


def test_triton_by_name_refuses_meta_tensors_under_the_interpreter():
    """The interpreter runs CPU tensors only: meta tensors asked of the Triton backend by name are
    refused with the reason (they reached the kernels and failed inside torch's copy until a
    review of 2026-12-05). The torch backend takes them (shapes only)."""
    from kda.triton.common import interpreting

    if not interpreting():
        pytest.skip("the CPU interpreter is off: without it any non-CUDA tensor is refused already")
    case = make_case(T=8, H=1, K=16, V=16, seed=2)
    meta = [x.to("meta") for x in case.tensors()]
    with pytest.raises(kda.BackendUnavailableError, match="triton.*tensors on meta"):
        kda.chunk_kda(*meta, backend="triton")
    o, _ = kda.chunk_kda(*meta, backend="torch")
    assert o.device.type == "meta" and o.shape == case.v.shape


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
def test_float64_goes_to_torch_with_logged_reason(caplog, op):
    """Each op's log lines name that op (a mutation audit of 2026-12-05 found every refusal
    logged as chunk_kda's would have passed: only chunk_kda was asked)."""
    case = make_case(T=8, H=1, K=16, V=16, dtype=torch.float64, seed=1)
    kw = case.kwargs()
    if op == "fused_recurrent_kda":
        kw.pop("safe_gate")
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="kda"), kda.record_dispatch() as events:
        getattr(kda, op)(*case.tensors(), **kw)
        getattr(kda, op)(*case.tensors(), **kw)
    assert events == [f"{op} -> torch", f"{op} -> torch"]
    lines = [r.getMessage() for r in caplog.records]
    assert f"[kda] {op} -> torch" in lines
    assert any(line.startswith(f"[kda] {op}: triton rejected: dtype torch.float64") for line in lines), lines
    assert lines.count(f"[kda] {op} -> torch") == 1, "a decision is logged once per process"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("scale, neg_eigval", [(None, False), (0.3, False), (None, True)])
def test_scale_and_beta_form_reach_every_backend(backend, op, scale, neg_eigval):
    """A scale of the caller's, the default K^-0.5 (K != V, so V^-0.5 would show) and
    allow_neg_eigval, through both ops on the torch and Triton backends, against
    reference.py's float64 token loop called directly (kda's usual yardstick is the torch
    backend behind the API, which shares whatever the API loses: a mutation audit of
    2026-12-05 found a dropped scale passing every test). fused_recurrent_kda's sequences are
    in the decode kernel's range, chunk_kda's past it."""
    case = make_case(seq_lens=[20, 5], H=1, HV=2, K=16, V=8, gate="softplus", device=DEVICE, seed=14)
    kw = case.kwargs(allow_neg_eigval=neg_eigval)
    if scale is not None:
        kw["scale"] = scale
    if op == "fused_recurrent_kda":
        kw.pop("safe_gate", None)
    with kda.record_dispatch() as events:
        o, ht = getattr(kda, op)(*case.tensors(), backend=backend, **kw)
    if backend == "triton":
        assert ("triton:decode" if op == "fused_recurrent_kda" else "triton:recurrence_v_split") in events, events
    o_ref, ht_ref = fp64_direct(case, scale=scale, allow_neg_eigval=neg_eigval)
    assert_close_fp64(o, o_ref, 1e-4, "o")
    assert_close_fp64(ht, ht_ref, 1e-4, "final state")


def test_torch_backend_is_differentiable():
    case = make_case(T=10, H=1, K=8, V=8, seed=2)
    q = case.q.clone().requires_grad_()
    o, ht = kda.chunk_kda(q, *case.tensors()[1:], **case.kwargs())
    (o.sum() + ht.sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_fused_recurrent_torch_equals_chunk_torch():
    case = make_case(seq_lens=[5, 0, 21], H=2, HV=4, K=8, V=8, gate="softplus", seed=3)
    kw = case.kwargs()
    o_c, h_c = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    kw.pop("safe_gate", None)
    o_r, h_r = kda.fused_recurrent_kda(*case.tensors(), backend="torch", **kw)
    assert torch.allclose(o_c, o_r, atol=1e-5) and torch.allclose(h_c, h_r, atol=1e-5)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kda", *args], capture_output=True, text=True, timeout=600)


def test_cli_info_prints_backends():
    res = run_cli("info")
    assert res.returncode == 0, res.stderr
    assert "| torch | yes | ready |" in res.stdout and "| cuda |" in res.stdout


def test_cli_compare_prints_table():
    res = run_cli("compare", "--T", "20", "--H", "1", "--D", "16", "--repeats", "1")
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| torch") or line.startswith("| triton")]
    assert len(rows) == 2, res.stdout
    for row in rows:
        o_err, state_err = (float(x) for x in row.split("|")[2:4])
        assert o_err < 1e-2 and state_err < 1e-2


def test_cli_compare_varlen_fp32():
    res = run_cli("compare", "--seq-lens", "7,0,18", "--H", "2", "--D", "16", "--dtype", "fp32", "--gate", "softplus")
    assert res.returncode == 0, res.stderr
    assert "| torch |" in res.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--T", "0"], "argument --T: expected a positive integer, got 0"),
        (["--seq-lens", "0,0"], "at least one length must be positive"),
        (["--seq-lens", "3,x"], "expected comma-separated integers"),
        (["--backends", "foo"], "unknown backend 'foo' (choose from cuda, triton, torch)"),
        (["--seq-lens", "5,3", "--batch", "2"], "leave out --batch and --T"),
        (["--H", "2", "--HV", "3"], "--HV must be a multiple of --H"),
        (["--D", "300", "--T", "4", "--backends", "torch"], "head dims must be <= 256"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    ],
)
def test_cli_compare_refuses_bad_arguments_in_one_line(args, says):
    res = run_cli("compare", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], res.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cases", "abc"], "argument --cases: expected comma-separated case numbers"),
        (["--cases", "-1"], "argument --cases: expected comma-separated case numbers"),
        (["--cases", "99"], "--cases: no case 99 (the anchor cases are 0 to"),
        (["--long", "--cases", "0,12"], "--cases: no case 12 (the long cases are 0 to"),
        (["--train", "--cases", "40"], "--cases: no case 40 (the training cases are 0 to"),
        (["--decode", "--cases", "0"], "--decode times its fixed cases and every contender"),
        (["--decode", "--impls", "fla"], "--decode times its fixed cases and every contender"),
    ],
)
def test_cli_bench_refuses_bad_arguments_in_one_line_before_any_work(args, says):
    """`kda bench` with a bad --cases, or options --decode would ignore: one line and status 2,
    on any machine (checked before the GPU test), where --cases ended in a traceback after the
    bench's first GPU work and --decode dropped --impls and --cases unread (a review, 2026-12-07)."""
    res = run_cli("bench", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for the CUDA backend where no GPU makes it unavailable")
def test_cli_compare_fails_on_an_unavailable_backend_asked_for_by_name():
    res = run_cli("compare", "--backends", "cuda", "--T", "4")
    assert res.returncode == 1 and "| cuda |" not in res.stdout, res.stdout + res.stderr
    # the reason is this machine's (no GPU; or no cuda-bindings, as in a fresh `.[test]` venv)
    from kda.cuda import BACKEND as CUDA

    why = CUDA.availability()
    assert why, "the test assumes the CUDA backend is unavailable here"
    assert res.stderr.strip() == f"kda compare: error: backend 'cuda' is unavailable: {why}"


def test_cli_version_and_closed_pipe():
    import kda

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kda {kda.__version__}", res.stdout + res.stderr
    # `kda info | head -0`: the reader is gone before the first write
    proc = subprocess.Popen([sys.executable, "-m", "kda", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Error" not in err, err


def test_bench_table_renders_every_section():
    """The bench's Markdown (what the README shows) from a synthetic report: CPU-checkable."""
    from kda import bench

    report = {
        "gpu": "GPU", "date": "2026-11-30", "versions": {"kda": "0.1.0"},
        "cases": [{"case": "1x8192 H96", "floor_ms": 0.24, "ms": {"kda-cuda": 0.9, "fla": 2.6},
                   "ratio_to_fla": {"kda-cuda": 0.346, "fla": 1.0}, "flash_kda_ratio_anchor": 0.534,
                   "pass_ms": {"kda-cuda": [0.91, 0.9], "fla": [2.6, 2.6]},
                   "pass_clocks": {"kda-cuda": [{"sm_mhz": 1980.0, "power_w_max": 300.0, "power_capped": 0.0,
                                                 "samples": 1},
                                                {"sm_mhz": 1830.0, "power_w_max": 690.0, "power_capped": 1.0,
                                                 "samples": 3}],
                                   "fla": [None, None]}}],
        "accuracy_vs_fp64": [{"case": "lens [1024]", "impl": "kda-cuda", "o": 3e-3, "final_state": 2e-3}],
        "host_overhead_tiny_call": {"kda-cuda": {"eager_host_us": 31.0, "eager_host_us_min": 29.0,
                                                  "eager_host_us_max": 35.5, "graph_replay_us": 9.0}},
        "state_layout_ms_1x8192_H96": {"kda-cuda": {"VK": 0.9, "KV": 0.95}},
        "kernel_ms_1x8192_H96": {"kda-cuda": {"kda_prepare": 0.3, "kda_recurrence": 0.6}},
    }  # fmt: skip
    table = bench.markdown_table(report)
    for expected in ("| 1x8192 H96 | 0.240 | 0.900 | 2.600 | 0.346 | 0.534 |", "| kda-cuda | 31.0 (29.0-35.5) | 9.0 |",
                     "| kda-cuda | 0.900 | 0.950 |", "| kda-cuda | kda_recurrence | 0.600 |",
                     "| 1x8192 H96 | kda-cuda | 0.910, 0.900 | 1980, 1830 | 75% |",
                     "| 1x8192 H96 | fla | 2.600, 2.600 | -, - | 0% |"):  # fmt: skip
        assert expected in table, table


def test_bench_precomputed_gate_case_is_the_softplus_gate_applied_outside():
    """The bench's Kimi-Linear serving case (make_inputs' "precomputed") times the function the
    in-kernel softplus gate and beta sigmoid compute: gate_outside's call gives the in-kernel
    call's o and state, and is far off where the parameters differ;
    the case's own inputs are in that form, with kimi_gate_params' ranges, and its floor counts
    g's and beta's float32 bytes."""
    import kda
    from kda import bench

    case = dict(bench.ANCHOR_CASES[-1], seq_lens=[40, 27], H=2)
    assert case["gate"] == "precomputed"
    tensors, kw = bench.make_inputs(dict(case, gate="softplus"), device="cpu", seed=3)
    kw["A_log"], kw["dt_bias"] = bench.kimi_gate_params(2, torch.Generator().manual_seed(4), "cpu")
    outside, outside_kw = bench.gate_outside(tensors, kw)
    inside_o, inside_s = kda.chunk_kda(*tensors, **kw, backend="torch")
    o, s = kda.chunk_kda(*outside, **outside_kw, backend="torch")
    assert rel(o.float(), inside_o.float()) < 1e-5 and rel(s, inside_s) < 1e-5
    other, other_kw = bench.gate_outside(tensors, dict(kw, A_log=kw["A_log"] + 0.5))
    assert rel(kda.chunk_kda(*other, **other_kw, backend="torch")[0].float(), inside_o.float()) > 4e-2

    (*_, g, beta), case_kw = bench.make_inputs(case, device="cpu", seed=3)
    assert g.dtype == beta.dtype == torch.float32 and bool((g <= 0).all() and (g < 0).any())
    assert not case_kw["use_gate_in_kernel"] and not case_kw["use_beta_sigmoid_in_kernel"]
    assert {"A_log", "dt_bias", "lower_bound", "safe_gate"}.isdisjoint(case_kw)
    A_log, dt_bias = bench.kimi_gate_params(64, torch.Generator().manual_seed(0), "cpu")
    softplus = torch.nn.functional.softplus(dt_bias)
    assert A_log.exp().min() >= 1 and A_log.exp().max() <= 16
    assert softplus.min() >= 0.99e-3 and softplus.max() <= 0.101
    assert bench.floor_bytes(case) - bench.floor_bytes(dict(case, gate="lower_bound")) == 67 * 2 * 129 * 2


@pytest.mark.parametrize(
    "name, slug",
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("NVIDIA GH200 480GB", "gh200"), ("Some Card", "card")],
)  # fmt: skip
def test_bench_files_are_named_by_the_gpu_model(name, slug):
    """Result files start with the GPU's model: the H100 reports "... HBM3" last, and run 147's
    files were named hbm3-...; a name with no model in it gives its last word."""
    from kda import bench

    assert bench.gpu_slug(name) == slug


def test_bench_impls_filter_keeps_the_order_asked_and_refuses_an_unknown_name(capsys):
    """``--impls`` for every bench mode (run 47's ``--train`` ignored it and ran kda-triton too)."""
    from kda import bench

    calls = {"kda-triton": 1, "kda-cuda": 2, "fla": 3}
    assert bench.pick_impls(calls, None) is calls
    assert list(bench.pick_impls(calls, "fla,kda-cuda").items()) == [("fla", 3), ("kda-cuda", 2)]
    assert bench.pick_impls(calls, "kda-cuda,flashkda") is None
    assert "['flashkda'] not available here" in capsys.readouterr().out


def test_bench_times_every_contender_in_every_pass_after_all_first_calls(monkeypatch):
    """``kda bench``'s anchors: every contender's first call (compile, autotune) before any
    timing, then passes over all contenders in turn, each contender's figure the median of its
    passes (an order effect of several percent moved single figures, runs 94 and 97)."""
    pytest.importorskip("triton")
    import triton.testing

    from kda import bench

    events, readings = [], {"a": iter([3.0, 1.0, 2.5]), "b": iter([5.0, 9.0, 6.0])}

    inside = {"a": [], "b": []}  # host times within each timing

    def do_bench(fn, **options):
        fn()
        name = events[-1][1]
        events.append(("timed", name))
        inside[name].append(time.time())
        return next(readings[name])

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = {name: (lambda t, kw, name=name: events.append(("call", name))) for name in ("a", "b")}
    ms, first_call_s, pass_ms, pass_clocks = bench.time_calls(calls, (), {}, passes=3)
    assert events[:2] == [("call", "a"), ("call", "b")]
    assert [name for kind, name in events[2:] if kind == "timed"] == ["a", "b"] * 3
    assert pass_ms == {"a": [3.0, 1.0, 2.5], "b": [5.0, 9.0, 6.0]} and ms == {"a": 2.5, "b": 6.0}  # medians, not means
    assert set(first_call_s) == {"a", "b"}
    assert pass_clocks == {"a": [None] * 3, "b": [None] * 3}  # no sampler given

    class Windows:  # a sampler that says which span it was asked about, and when
        asked = []

        def windows(self, spans):
            Windows.asked.append((time.time(), list(spans)))
            return [{"sm_mhz": t1 - t0, "power_w_max": 1.0, "power_capped": 0.0, "samples": 1} for t0, t1 in spans]

    readings.update(a=iter([1.0] * 3), b=iter([1.0] * 3))
    inside.update(a=[], b=[])
    _, _, _, pass_clocks = bench.time_calls(calls, (), {}, passes=3, clocks=Windows())
    (asked_at_a, spans_a), (asked_at_b, spans_b) = Windows.asked  # once a contender, after every pass
    for spans, within in ((spans_a, inside["a"]), (spans_b, inside["b"])):
        assert len(spans) == 3 and all(t0 <= t <= t1 for (t0, t1), t in zip(spans, within))  # each encloses its timing
    assert max(t1 for _, t1 in spans_a + spans_b) <= min(asked_at_a, asked_at_b)
    assert [c["sm_mhz"] for c in pass_clocks["a"]] == [t1 - t0 for t0, t1 in spans_a]  # in pass order


def test_train_bench_table_and_plot_take_a_contender_a_case_did_not_run(tmp_path):
    """``kda bench --train`` Markdown from a synthetic report where kda-cuda ran the first case
    and refused the second (the softplus gate): "-" cells, its kernels apart, the refusal said."""
    from kda import bench

    grads = dict.fromkeys(bench.GRAD_NAMES, 2e-3)
    report = {
        "gpu": "GPU", "date": "2026-12-02", "versions": {"kda": "0.1.0"},
        "cases": [
            {"case": "1x8192 H32", "fwd_ms": {"kda-triton": 0.8, "kda-cuda": 0.5, "fla": 1.9},
             "fwd_bwd_ms": {"kda-triton": 5.0, "kda-cuda": 4.6, "fla": 4.6},
             "peak_extra_GB": {"kda-triton": 1.9, "kda-cuda": 1.9, "fla": 2.0},
             "fwd_bwd_ratio_to_fla": {"kda-triton": 1.087, "kda-cuda": 1.0, "fla": 1.0},
             "kernel_ms": {"kda-triton": {"prepare_chunks_kernel": 0.6}, "kda-cuda": {"kda_recurrence": 0.3}},
             "not_run": {}},
            {"case": "1x8192 H32 softplus", "fwd_ms": {"kda-triton": 0.9, "fla": 1.5},
             "fwd_bwd_ms": {"kda-triton": 6.0, "fla": 5.9}, "peak_extra_GB": {"kda-triton": 1.9, "fla": 2.0},
             "fwd_bwd_ratio_to_fla": {"kda-triton": 1.017, "fla": 1.0},
             "kernel_ms": {"kda-triton": {"prepare_chunks_kernel": 0.9}},
             "not_run": {"kda-cuda": "backend='cuda' cannot run it: the softplus gate"}},
        ],
        "grad_accuracy_vs_fp64": [dict(grads, case="lens [1024] H32", impl="kda-cuda")],
    }  # fmt: skip
    table = bench.train_markdown_table(report)
    expected = (
        "| 1x8192 H32 softplus | 6.000 | - | 5.900 | 1.017 | - |",
        "| 1x8192 H32 | kda-cuda | kda_recurrence | 0.300 |",
        "1x8192 H32 softplus, kda-cuda not run: backend='cuda' cannot run it: the softplus gate",
    )
    for line in expected:
        assert line in table, table
    bench.train_plot(report, tmp_path / "train.png")  # no KeyError for the missing bars


def test_bench_checks_what_it_times_and_keeps_every_run(tmp_path):
    """The bench's own checks (a review of the bench, 2026-12-07): a contender whose outputs on
    the timed inputs are off the others' is named and given no ratio; a wrong-shaped output
    does not score as exact; a second run's files do not replace the first's; the decode
    floor counts the bytes a plain call writes (float32 states, fla's only kind)."""
    from kda import bench, bench_decode, reference

    case = make_case(T=20, H=2, K=16, V=16, seed=7)
    t, kw = case.tensors(), case.kwargs(backend="torch")
    good = lambda t, kw: kda.chunk_kda(*t, **kw)  # noqa: E731
    calls = {"fla": good, "kda-ok": good, "kda-zero": lambda t, kw: tuple(torch.zeros_like(x) for x in good(t, kw)),
             "kda-nan": lambda t, kw: tuple(x * float("nan") for x in good(t, kw))}  # fmt: skip
    checks = bench.agreement(calls, t, kw)
    assert set(checks) == {"kda-ok", "kda-zero", "kda-nan"} and checks["kda-ok"]["o"] == 0.0, checks
    assert bench.disagreeing(checks) == ["kda-zero", "kda-nan"], checks
    with pytest.raises(ValueError, match="relative_rms"):
        reference.relative_rms(torch.ones(1), torch.ones(4, 3))
    first = bench.unused_stem(tmp_path / "h200-2026-12-07")
    assert first == tmp_path / "h200-2026-12-07"
    (tmp_path / "h200-2026-12-07.md").write_text("run 1")
    assert bench.unused_stem(tmp_path / "h200-2026-12-07") == tmp_path / "h200-2026-12-07-2"
    per_state = 32 * 128 * 128
    assert bench_decode.state_bytes(1, torch.bfloat16) == per_state * 4
    assert bench_decode.state_bytes(1, torch.bfloat16, written=torch.float32) == per_state * 6
    slots = {order: bench_decode.kw_indices(64, order, device="cpu") for order in bench_decode.SLOT_ORDERS}
    for order, x in slots.items():  # each a permutation of the pool's 64 slots, as int32
        assert x.dtype == torch.int32 and sorted(x.tolist()) == list(range(64)), (order, x)
    assert slots["reversed"].tolist() == list(range(63, -1, -1)) and slots["ascending"].tolist() == list(range(64))
    assert slots["random"].tolist() not in (slots["reversed"].tolist(), slots["ascending"].tolist())
    with pytest.raises(ValueError, match="order must be one of"):
        bench_decode.kw_indices(4, "shuffled", device="cpu")
    # the bench's modes -> slot orders: plain calls none, every pool row one, a wrong name refused
    # (a pool mode read as a plain call would time plain calls under a pool's label)
    assert [bench_decode.slot_order(m) for m in bench_decode.PLAIN_MODES] == [None, None]
    assert [bench_decode.slot_order(m) for m in bench_decode.POOL_MODES] == ["reversed", "random"]
    assert bench_decode.slot_order("pool_ascending") == "ascending"
    for bad in ("random", "pool_shuffled", "pools", "plain_bf16"):
        with pytest.raises(ValueError, match="unknown decode mode"):
            bench_decode.slot_order(bad)
    assert set(bench.build_record()) == {"commit", "changed_files", "kernels", "kernels_stamp", "settings"}


def test_decode_and_long_bench_tables_render_every_section(monkeypatch):
    """``kda bench --decode`` and ``--long`` Markdown from synthetic reports (their device runs
    write the table after every case: a formatting error would end a run), and the long
    bench's KDA_SEGMENT_TOKENS setting restored after each timed call."""
    import os

    from kda import bench_decode, bench_long

    head = {"gpu": "GPU", "date": "2026-12-01", "versions": {"kda": "0.1.0"}, "timing": "median",
            "measured_copy_TBps": 4.27, "inputs": "bf16"}  # fmt: skip
    decode = dict(head, cases=[{"N": 32, "state": "float32", "mode": "plain", "floor_ms": 0.0314,
                                "state_copy_graph_ms": 0.037, "kda_graph_ms": 0.0435, "fla_graph_ms": 0.0508,
                                "ratio_graph": 0.856, "kda_bandwidth_fraction": 0.72,
                                "kda_graph_clock": {"sm_mhz": 1980.0, "power_w_max": 400.0, "power_capped": 0.25,
                                                    "samples": 4}, "fla_graph_clock": None}],
                  accuracy_vs_fp64_N32_T4={"kda": {"o": 1.66e-3, "state": 8.6e-8}},
                  prefill_varlen={"sequences": 32, "longest": 512, "mean_tokens": 8293.0,
                                  "kda": {"eager_ms": 0.354, "host_ms": 0.268, "host_sync": "none"}},
                  layouts_fp32_plain={32: {"k_first_ms": 0.0435, "v_first_ms": 0.04}},
                  crossover_N32=[{"T": 1, "decode": 0.046, "triton_chunks": 0.081}])  # fmt: skip
    table = bench_decode.markdown_table(decode)
    for expected in ("| float32 | plain | 32 | 0.0314 | 0.0370 | 0.0435 | 0.0508 | 0.856 | 0.72 |",
                     "kda 0.3540 ms per call, host 0.2680 ms, syncs: none", "N=32: 0.0435 / 0.0400",
                     "T=1: decode 0.0460", "| float32 | plain | 32 | kda | 0.0435 | 1980 | 25% |"):  # fmt: skip
        assert expected in table, table
    assert "| fla | 0.0508 |" not in table, table  # no samples, no clock row
    long = dict(head, cases=[{"case": "1x2097152 H8", "floor_ms": 5.0, "ms": {"kda-cuda": 94.0, "fla": 89.5},
                              "ratio_to_fla": {"kda-cuda": 1.05, "fla": 1.0}, "target_ratio": 0.25,
                              "split_vs_uncut": {"kda-cuda-seg4096": {"o": 1e-3, "state": 2e-3}},
                              "clocks": {"kda-cuda": {"sm_mhz": 1830.0, "power_w_max": 690.0, "power_capped": 0.5,
                                                      "samples": 10}, "fla": None}}])  # fmt: skip
    table = bench_long.markdown_table(long)
    assert "| 1x2097152 H8 | 5.000 | 89.500 (1.000) | 94.000 (1.050) | 0.25 |" in table, table
    assert "1x2097152 H8 kda-cuda-seg4096: o 1.0e-03, state 2.0e-03" in table, table
    assert "1x2097152 H8 kda-cuda 1830 MHz (50% under the power cap)" in table, table

    monkeypatch.setenv(bench_long.SETTING, "32")
    assert bench_long.with_segments(4096, lambda: os.environ[bench_long.SETTING])() == "4096"
    assert os.environ[bench_long.SETTING] == "32"
    monkeypatch.delenv(bench_long.SETTING)
    bench_long.with_segments(16, lambda: None)()
    assert bench_long.SETTING not in os.environ


def test_long_bench_split_rows_go_on_past_a_variant_out_of_memory(monkeypatch):
    """``kda bench --long``'s uncut and split variants: one the card cannot hold (timed, or only
    its check) is recorded with the error's first line and the others still run (run 147, an 80
    GB H100, lost the 2M-token row to one); the check runs on the lowered gate, against the
    uncut call, and the segment setting is restored."""
    from kda import bench_long
    from kda.segments import SETTING

    monkeypatch.delenv(SETTING, raising=False)
    seen = []

    def call(tensors, kw):
        q, k, v, g, beta = tensors
        tokens, checking = os.environ[SETTING], bool(g.mean() < -SPLIT_SHIFT_SEEN)
        seen.append((tokens, checking))
        if tokens == "16384" or (tokens == "65536" and checking):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB\nthe rest")
        moved = 0.0 if tokens == "0" else int(tokens) * 1e-8  # each split its own distance from uncut
        return v * (1 + moved), v.sum(1) * (1 + 2 * moved)

    SPLIT_SHIFT_SEEN = bench_long.SPLIT_CHECK_GATE_SHIFT / 2
    monkeypatch.setattr(bench_long, "timed", lambda fn: (fn(), 2.5)[1])
    tensors = tuple(torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(4)) + (torch.rand(1, 8, 2),)
    row = {"case": "1x8 H2", "ms": {}}
    bench_long.split_rows(call, tensors, {}, row)
    assert SETTING not in os.environ
    assert row["ms"] == {"kda-cuda-uncut": 2.5, "kda-cuda-seg8192": 2.5, "kda-cuda-seg32768": 2.5,
                         "kda-cuda-seg65536": 2.5}  # fmt: skip
    first_line = "CUDA out of memory. Tried to allocate 16.00 GiB"
    assert row["out_of_memory"] == {"kda-cuda-seg16384": first_line, "kda-cuda-seg65536 (check)": first_line}
    assert set(row["split_vs_uncut"]) == {"kda-cuda-seg8192", "kda-cuda-seg32768"}
    for tokens in (8192, 32768):
        distance = row["split_vs_uncut"][f"kda-cuda-seg{tokens}"]
        assert distance["o"] == pytest.approx(tokens * 1e-8) and distance["state"] == pytest.approx(2 * tokens * 1e-8)
    assert ("0", True) in seen and ("8192", True) in seen and ("8192", False) in seen
    report = {"gpu": "GPU", "date": "2026-12-05", "versions": {}, "timing": "median", "measured_copy_TBps": 3.0,
              "inputs": "bf16", "cases": [dict(row, floor_ms=1.0)]}  # fmt: skip
    assert "Out of memory on this card, not run: 1x8 H2 kda-cuda-seg16384 (CUDA out of memory." in (
        bench_long.markdown_table(report)
    )


def test_long_bench_plot_draws_a_case_with_fla_and_skips_a_report_without(tmp_path):
    """``kda bench --long``'s plot (ratios to fla, the bar, the floor) from a synthetic report: a
    PNG for a case timed beside fla, nothing where no case was (no ratio to draw)."""
    pytest.importorskip("matplotlib", reason="matplotlib is the bench extra's, not the tests'")
    from kda import bench_long

    row = {"case": "1x2097152 H8", "floor_ms": 5.0, "ms": {"kda-cuda": 37.5, "fla": 99.7}, "target_ratio": 0.25,
           "ratio_to_fla": {"kda-cuda": 0.376, "fla": 1.0}}  # fmt: skip
    report = {"gpu": "GPU", "date": "2026-12-04", "cases": [row]}
    bench_long.plot(report, tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 1000
    alone = {"case": "1x2097152 H8", "floor_ms": 5.0, "ms": {"kda-cuda": 37.5}}
    bench_long.plot(dict(report, cases=[alone]), tmp_path / "alone.png")
    assert not (tmp_path / "alone.png").exists()


def test_importing_kda_leaves_triton_and_dynamo_unimported():
    """``import kda`` imports neither Triton nor torch._dynamo (which imports Triton): Triton
    reads TRITON_INTERPRET when it is imported, and the CLI sets it after importing kda. Nor
    fla (register_fla_backend imports it when called)."""
    code = "import sys, kda; print(sorted(m for m in ('triton', 'torch._dynamo', 'fla') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI sets TRITON_INTERPRET only where no GPU is visible")
def test_cli_compare_sets_the_interpreter_itself():
    """`kda compare` from a shell without TRITON_INTERPRET (the README's command on a CPU machine)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "kda", "compare", "--T", "20", "--H", "1", "--D", "16"],
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| triton |" in res.stdout, res.stdout


def test_device_guard_switches_only_when_another_device_is_current(monkeypatch):
    """Triton launches on torch's current device: kda makes the inputs' device current around
    its launches (dispatch.on_device_of), and skips the switch when it already is."""
    monkeypatch.setattr(dispatch, "_current_device", lambda: 0)
    assert dispatch.on_device(0) is dispatch._STAY  # already current: nothing to switch (no CUDA needed)
    assert isinstance(dispatch.on_device(1), torch.cuda.device)
    assert dispatch.on_device_of(torch.zeros(1)) is dispatch._STAY  # CPU tensors: no device


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (inputs on the one that is not current)")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_inputs_on_a_device_that_is_not_current(backend):
    """Inputs on cuda:1 while cuda:0 is current: the forward, the decode step and (Triton) the
    backward run on cuda:1 and equal the same calls made with cuda:1 current, bit for bit."""
    from helpers import cuda_ready, gradients

    if backend == "cuda" and cuda_ready.args[0]:
        pytest.skip(cuda_ready.kwargs["reason"])
    case = make_case(seq_lens=[40, 70], H=2, K=128, V=128, gate="lower_bound", seed=61).to(torch.bfloat16, "cuda:1")
    step = make_case(B=3, T=1, H=2, K=128, V=128, gate="lower_bound", seed=62).to(torch.bfloat16, "cuda:1")
    step_kw = {n: x for n, x in step.kwargs().items() if n != "safe_gate"}  # not a fused_recurrent_kda argument
    results = {}
    for current in (0, 1):
        with torch.cuda.device(current):
            o, ht = kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
            od, hd = kda.fused_recurrent_kda(*step.tensors(), backend="triton", **step_kw)
            grads = gradients(case, "triton") if backend == "triton" else {}
            torch.cuda.synchronize(1)
        results[current] = [o, ht, od, hd, *grads.values()]
    for a, b in zip(*results.values()):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)
