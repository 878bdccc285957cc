"""``kda bench``: the anchor cases, every available kda backend beside fla's ``chunk_kda``
(fla's own kernels: ``FLA_FLASH_KDA=0 FLA_KDA=0``) and FlashKDA when importable, same inputs,
same process, median of ``triton.testing.do_bench``. Writes JSON, a Markdown table and a PNG
plot."""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from kda import abi, reference
from kda.clocks import ClockSampler

# bf16, K = V = 128, lower-bound gate lb = -5, l2norm and beta sigmoid fused, fp32 state [N, H, V, K].
ANCHOR_CASES = [
    {"name": "1x8192 H96", "seq_lens": [8192], "H": 96},
    {"name": "varlen6 H96", "seq_lens": [1300, 547, 2048, 963, 271, 3063], "H": 96},
    {"name": "varlen 1024x8 H96", "seq_lens": [1024] * 8, "H": 96},
    {"name": "1x8192 H64", "seq_lens": [8192], "H": 64},
    {"name": "1x32768 H32", "seq_lens": [32768], "H": 32},
    {"name": "16x4096 H32", "batch": 16, "T": 4096, "H": 32},
    {"name": "16x2048 H16", "batch": 16, "T": 2048, "H": 16},
    # Kimi-Linear-48B as vLLM and the HF modeling code call it (shared/design/anchors.md): its
    # unbounded softplus gate computed outside the kernel (make_inputs' "precomputed"), which
    # FlashKDA cannot serve and kda's CUDA path takes through K1's far entry point; a prefill
    # batch of varlen6's lengths at its 32 heads, whose 192 (sequence, head) pairs fill the SMs
    # (the wgmma K2 through that entry point's twin; the mma.sync one under KDA_CUDA_FAR_WGMMA=0)
    {
        "name": "varlen6 H32 precomputed gate",
        "seq_lens": [1300, 547, 2048, 963, 271, 3063],
        "H": 32,
        "gate": "precomputed",
    },
]
# FlashKDA / fla ratios measured on the same kind of H200 (shared/anchors/h200-2026-11-30.json).
FLASH_KDA_RATIO = {
    "1x8192 H96": 0.534,
    "varlen6 H96": 0.526,
    "varlen 1024x8 H96": 0.455,
    "1x8192 H64": 0.687,
    "1x32768 H32": 1.039,
}
D = 128
COPY_TBPS_FALLBACK = 4.27
# What makes fla's KDA entry points run fla's own Triton kernels, for a figure "beside fla": its
# FlashKDA backend off, and kda's off too. fla reads both at every call; after
# `kda.register_fla_backend()` in the same process (tests/test_fla.py leaves it registered for its
# pytest worker) fla's chunk_kda would run kda, and a comparison with it would be kda's with itself
# (run 177, 2026-12-06: the bf16 gradient test beside fla reached kda that way).
FLA_OWN_KERNELS = {"FLA_FLASH_KDA": "0", "FLA_KDA": "0"}


def fla_own_kernels() -> None:
    """Make fla's KDA entry points run fla's own kernels in this process (:data:`FLA_OWN_KERNELS`)."""
    os.environ.update(FLA_OWN_KERNELS)


def kimi_gate_params(H: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log [H], dt_bias [H * D])`` of make_inputs' "precomputed" gate: A_log = log U(1, 16)
    (fla's initial values) and dt_bias with softplus(dt_bias) log-uniform in [1e-3, 1e-1] (Mamba2's
    dt initialisation)."""
    A_log = torch.empty(H, device=device).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(H * D, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    return A_log, dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt


def make_inputs(case: dict, device: str = "cuda", seed: int = 0) -> tuple[tuple, dict]:
    """Random bf16 inputs of ``case`` (seq_lens or batch x T, H; gate "lower_bound", the default,
    "softplus", the gate of Kimi Linear and of fla's chunk_kda without safe_gate, or "precomputed":
    that gate and beta's sigmoid applied outside the kernel by :func:`gate_outside`, with
    :func:`kimi_gate_params`' parameters. A channel's log-decay a token then spans about 1e-3 to 3.6
    (1st to 99th percentile on CPU draws of seeds 0-3), and a few (chunk, head) pairs of a call pass
    K1's factored range, whose rows take the pairwise form: the case times mostly the far entry
    point's fixed cost)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H = case["H"]
    if "seq_lens" in case:
        lens = case["seq_lens"]
        B, T, N = 1, sum(lens), len(lens)
        cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
        cu = cu_cpu.to(device)
    else:
        B, T, N = case["batch"], case["T"], case["batch"]
        cu = cu_cpu = None

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    tensors = (randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H))
    kwargs = dict(
        initial_state=randn(N, H, D, D, dtype=torch.float32),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=-5.0,
        state_v_first=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
        A_log=torch.rand(H, generator=gen, device=device),
        dt_bias=torch.rand(H * D, generator=gen, device=device),
    )
    gate = case.get("gate", "lower_bound")
    if gate in ("softplus", "precomputed"):
        del kwargs["safe_gate"], kwargs["lower_bound"]
    if gate == "precomputed":
        kwargs["A_log"], kwargs["dt_bias"] = kimi_gate_params(H, gen, device)
        tensors, kwargs = gate_outside(tensors, kwargs)
    return tensors, kwargs


def gate_outside(tensors: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The same call with its in-kernel softplus gate and beta sigmoid applied before it (the
    reference's own functions): g and beta in float32, as vLLM's Kimi-Linear layer passes them
    (``fused_kda_gate``'s g; ``b_proj(x).float().sigmoid()``)."""
    q, k, v, g, beta = tensors
    _, _, g, beta = reference.activate_inputs(
        q, k, g.float(), beta.float(), use_gate=True, use_beta_sigmoid=True, A_log=kwargs["A_log"],
        dt_bias=kwargs["dt_bias"].view(g.shape[-2], -1),
    )  # fmt: skip
    rest = {name: x for name, x in kwargs.items() if name not in ("A_log", "dt_bias")}
    return (q, k, v, g, beta), dict(rest, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)


def floor_bytes(case: dict) -> int:
    """Bytes that must move: q, k, v, g, beta read once (bf16; g and beta float32 in the
    precomputed-gate case), o written once, states read and written (fp32)."""
    H = case["H"]
    T = sum(case["seq_lens"]) if "seq_lens" in case else case["batch"] * case["T"]
    N = len(case["seq_lens"]) if "seq_lens" in case else case["batch"]
    gate_bytes = 4 if case.get("gate") == "precomputed" else 2  # of g and beta
    return T * H * (4 * D * 2 + (D + 1) * gate_bytes) + 2 * N * H * D * D * 4


def floor_ms(nbytes: int, copy_tbps: float) -> float:
    """Milliseconds to move ``nbytes`` at the measured copy bandwidth (a case's floor)."""
    return nbytes / (copy_tbps * 1e12) * 1e3


def measure_copy_tbps() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    import triton.testing

    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    return 2 * 2 * 1024**3 / (ms * 1e-3) / 1e12


def report_header(timing: str, inputs: str) -> tuple[dict, float, str]:
    """``(report, copy TB/s, file stem)`` of a bench run: the GPU, date, versions and measured
    copy bandwidth every report starts with, and ``<gpu>-<date>`` for its file names."""
    copy_tbps = measure_copy_tbps()
    props = torch.cuda.get_device_properties(0)
    date = datetime.date.today().isoformat()
    report = {
        "gpu": props.name, "sms": props.multi_processor_count, "date": date, "versions": versions(),
        "build": build_record(), "measured_copy_TBps": copy_tbps, "timing": timing, "inputs": inputs,
    }  # fmt: skip
    return report, copy_tbps, f"{gpu_slug(props.name)}-{date}"


SETTINGS_PREFIXES = ("KDA_", "FLA_", "TRITON_")


def build_record() -> dict:
    """What ran, beyond the versions: the checkout's commit (and whether it had changes), the
    CUDA kernels' folder and stamp, and the KDA_ / FLA_ / TRITON_ settings of the environment
    (two runs' files differed only in a setting their names alone recorded until 2026-12-07)."""
    import subprocess

    from kda.cuda import loader

    root = Path(__file__).resolve().parents[2]

    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    folder = loader.artefact_dir()
    stamp = None if folder is None else (folder / abi.HEADER_ID_FILE)
    return {
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "changed_files": git("status", "--porcelain", "--untracked-files=no"),
        "kernels": None if folder is None else str(folder),
        "kernels_stamp": stamp.read_text().strip() if stamp is not None and stamp.is_file() else None,
        "settings": {name: value for name, value in sorted(os.environ.items()) if name.startswith(SETTINGS_PREFIXES)},
    }


def gpu_slug(name: str) -> str:
    """A GPU's short name for result files: its model ("NVIDIA H200" and "NVIDIA H100 80GB HBM3"
    give h200 and h100; the last word, which the H100 reports as "HBM3", named run 147's files
    hbm3-...), else the name's last word."""
    model = re.search(r"\b[A-Z]{1,2}\d{2,4}[A-Za-z]?\b", name)
    return (model.group(0) if model else name.split()[-1]).lower()


def contenders() -> dict:
    """name -> callable(tensors, kwargs) for every implementation present."""
    import kda

    def kda_call(t, kw, name):
        with torch.inference_mode():  # every contender in one grad mode (fla's was alone in it until 2026-12-07)
            return kda.chunk_kda(*t, backend=name, **kw)

    out = {}
    for b in kda.backends():
        if b.available and b.name != "torch":
            out[f"kda-{b.name}"] = lambda t, kw, name=b.name: kda_call(t, kw, name)
    if importlib.util.find_spec("fla") is not None:
        fla_own_kernels()
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        def fla_call(t, kw):
            with torch.inference_mode():
                return fla_chunk_kda(*t, **kw)

        out["fla"] = fla_call
    # (FlashKDA's figures are the anchors' in ../shared/design/anchors.md: its `fwd` takes another
    # signature than these calls', so a FlashKDA installed here would have been timed wrongly; the
    # contender went, 2026-12-07, a review of the bench)
    return out


def start_jsonl(out, **extra) -> dict:
    """The first line of a device experiment's JSON-lines log (the GPU, the date, the versions and
    ``extra``), printed and written to the open file ``out``; returned."""
    head = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "versions": versions(), **extra}
    line = json.dumps(head)
    print(line, flush=True)
    out.write(line + "\n")
    return head


def versions() -> dict:
    import triton

    import kda

    v = {"kda": kda.__version__, "torch": torch.__version__, "triton": triton.__version__,
         "python": platform.python_version(), "cuda": torch.version.cuda}  # fmt: skip
    for mod in ("fla", "flash_kda"):
        if importlib.util.find_spec(mod) is not None:
            try:
                from importlib.metadata import version

                v[mod] = version("fla-core" if mod == "fla" else "flash-kda")
            except Exception:  # noqa: BLE001 - the version is informational
                v[mod] = "installed"
    return v


def float64_kw(kw: dict) -> dict:
    """``kw`` with its floating-point tensors (A_log, dt_bias, initial_state) in float64."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}


def reference64(tensors: tuple, kw: dict) -> tuple:
    """``(o, final_state)`` of a ``make_inputs`` problem by the torch backend in float64."""
    import kda

    return kda.chunk_kda(*(x.double() for x in tensors), backend="torch", **float64_kw(kw))


def accuracy_rows(calls: dict) -> list[dict]:
    """The anchors' accuracy cases: relative RMS against fp64 of o and the final state."""
    from kda.reference import relative_rms

    rows = []
    for lens in ([1024], [512, 300, 777]):
        tensors, kw = make_inputs({"seq_lens": lens, "H": 8}, seed=1)
        o_ref, h_ref = reference64(tensors, kw)
        for name, call in calls.items():
            o, h = call(tensors, kw)
            rows.append(
                {
                    "case": f"lens {lens}",
                    "impl": name,
                    "o": relative_rms(o, o_ref),
                    "final_state": relative_rms(h, h_ref),
                }
            )
    return rows


KERNEL_NAMES = (
    "kda_prepare", "kda_recurrence", "kda_state_grad_chain",
    "prepare_chunks_kernel", "recurrence_v_split_kernel", "state_grad_chain_kernel",
    "chunk_state_grads_kernel", "chunk_du_grads_kernel", "chunk_input_grads_kernel", "kda_state_products",
)  # fmt: skip


def kernel_times(run, iters: int = 20) -> dict:
    """GPU ms per ``run()`` of each kda kernel, from the torch profiler's CUDA activity (a
    kernel launched twice per run, like the training step's prepare, counts both)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        kernel = next((k for k in KERNEL_NAMES if event.key.startswith(k)), None)
        if kernel:
            total_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
            times[kernel] = times.get(kernel, 0.0) + total_us / iters / 1e3
    return times


def kernel_split(calls: dict, case: dict, iters: int = 20) -> dict:
    """Per-kernel GPU time (ms per call) of each kda backend on ``case``: how the time divides
    between prepare (K1) and recurrence (K2)."""
    tensors, kw = make_inputs(case)
    return {
        name: kernel_times(lambda call=call: call(tensors, kw), iters) for name, call in calls.items()
        if name.startswith("kda-")
    }  # fmt: skip


def layout_cost(calls: dict, case: dict) -> dict:
    """ms per call of each kda backend with the state in VK layout (native, the bench's
    default) and in KV layout (fla's default), on ``case``."""
    import triton.testing

    tensors, kw = make_inputs(case)
    kv = dict(kw, state_v_first=False, initial_state=kw["initial_state"].transpose(-1, -2).contiguous())
    rows = {}
    for name, call in calls.items():
        if name.startswith("kda-"):
            rows[name] = {
                layout: triton.testing.do_bench(lambda: call(tensors, k), warmup=25, rep=100, return_mode="median")
                for layout, k in (("VK", kw), ("KV", kv))
            }
    return rows


def host_overhead(calls: dict, iters: int = 200, rounds: int = 5) -> dict:
    """A tiny call (T = 64, H = 1): host microseconds per eager call (a loop of launches,
    then one sync, divided by the count; the median of ``rounds`` such means, as the GPU
    host's speed moves between them, with their spread beside it) and GPU microseconds per
    replay of a captured CUDA graph of the same call."""
    tensors, kw = make_inputs({"seq_lens": [64], "H": 1})
    rows = {}
    for name, call in calls.items():
        if not name.startswith("kda-"):
            continue
        for _ in range(3):
            call(tensors, kw)
        means = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                call(tensors, kw)
            means.append((time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
        means.sort()
        host_us = means[rounds // 2]
        row = {"eager_host_us": host_us, "eager_host_us_min": means[0], "eager_host_us_max": means[-1]}
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(tensors, kw)
            graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                graph.replay()
            torch.cuda.synchronize()
            row["graph_replay_us"] = (time.perf_counter() - start) / iters * 1e6
        except Exception as error:  # noqa: BLE001 - recorded, not fatal: the report says why
            row["graph_error"] = f"{type(error).__name__}: {error}"[:200]
        rows[name] = row
    return rows


def triton_configs() -> dict:
    """The autotuner's choice for the last shape each Triton kernel ran on (for the record)."""
    from kda.triton.prepare import prepare_chunks_kernel
    from kda.triton.recurrence import recurrence_v_split_kernel

    kernels = {"prepare": prepare_chunks_kernel, "recurrence": recurrence_v_split_kernel}
    return {name: str(getattr(kernel, "best_config", None)) for name, kernel in kernels.items()}


# do_bench passes over the contenders of a case, taken in turn (time_calls). The same call read
# 0.907-0.912 ms as the first case of a fresh process (benchmarks/prepare_ab.py, run 97) and
# 1.007-1.118 ms after three other cases (benchmarks/blocks_ab.py, run 94; 1x8192 H96, kda-cuda,
# H200, 2026-12-04): where in a run a contender is timed moves its figure, so each is timed in
# every pass, and the median of its passes is kept.
TIMING_PASSES = 3


# Two contenders' outputs on the timed inputs: each is about 3e-3 off float64 in bf16 (the accuracy
# rows), so they agree to well under this; a kernel wrong on a shape the accuracy rows do not cover
# (they take H = 8 and the lower-bound gate only) is off by O(1). Until 2026-12-07 nothing checked
# what was timed (a review of the bench).
AGREEMENT = 2e-2


def agreement(calls: dict, tensors: tuple, kw: dict) -> dict:
    """Each contender's o and final state against fla's (else the first contender's) on the
    inputs it is timed on: relative RMS, NaN where not finite (never within AGREEMENT)."""
    outs = {name: call(tensors, kw) for name, call in calls.items()}
    base = "fla" if "fla" in outs else next(iter(outs))
    o_ref, ht_ref = outs[base][0], outs[base][1]
    return {
        name: {
            "against": base,
            "o": reference.relative_rms(o, o_ref),
            "final_state": reference.relative_rms(ht.float(), ht_ref.float()),
        }  # fmt: skip
        for name, (o, ht, *_) in outs.items()
        if name != base
    }


def disagreeing(checks: dict) -> list[str]:
    """The contenders whose outputs :func:`agreement` found off by more than AGREEMENT."""
    return [name for name, c in checks.items() if not (c["o"] <= AGREEMENT and c["final_state"] <= AGREEMENT)]


def time_calls(calls: dict, tensors: tuple, kw: dict, passes: int = TIMING_PASSES, clocks=None) -> tuple:
    """``(ms, first_call_s, pass_ms, pass_clocks)`` per contender: every contender's first call
    first (its wall time: compile and autotune, where a bench run's time goes), then ``passes``
    rounds of one do_bench median each over all contenders in turn; ``ms`` is the median of a
    contender's rounds, ``pass_ms`` the rounds themselves (their spread is the figure's), and
    ``pass_clocks`` the GPU's clock during each round (``clocks``: a kda.clocks.ClockSampler;
    None entries without one)."""
    import triton.testing

    first_call_s, pass_ms = {}, {name: [] for name in calls}
    pass_clocks = {name: [] for name in calls}
    for name, call in calls.items():
        start = time.perf_counter()
        call(tensors, kw)
        torch.cuda.synchronize()
        first_call_s[name] = time.perf_counter() - start
    spans = {name: [] for name in calls}
    for _ in range(passes):
        for name, call in calls.items():
            t0 = time.time()
            pass_ms[name].append(
                triton.testing.do_bench(lambda c=call: c(tensors, kw), warmup=25, rep=100, return_mode="median")
            )
            spans[name].append((t0, time.time()))
    for name in calls:  # read after the passes, so that each window holds its last period's sample
        pass_clocks[name] = [None] * passes if clocks is None else clocks.windows(spans[name])
    ms = {name: statistics.median(rounds) for name, rounds in pass_ms.items()}
    for name in calls:
        rounds = ", ".join(f"{t:.3f}" for t in pass_ms[name])
        mhz = ", ".join("-" if c is None else f"{c['sm_mhz']:.0f}" for c in pass_clocks[name])
        print(f"  {name}: {ms[name]:.3f} ms (passes {rounds}; SM MHz {mhz}; first call {first_call_s[name]:.1f} s)",
              flush=True)  # fmt: skip
    return ms, first_call_s, pass_ms, pass_clocks


def pick_impls(calls: dict, impls: str | None) -> dict | None:
    """The implementations ``--impls`` names (comma-separated), in its order; all of them without
    it; None, said why, when it names one this machine lacks."""
    if not impls:
        return calls
    missing = [name for name in impls.split(",") if name not in calls]
    if missing:
        print(f"--impls: {missing} not available here; available: {sorted(calls)}")
        return None
    return {name: calls[name] for name in impls.split(",")}


def main(args) -> int:

    if not torch.cuda.is_available():
        print("kda bench needs a CUDA GPU (it times kernels); use `kda compare` on CPU")
        return 1
    if args.train:
        return train_main(args)
    if args.decode:
        from kda.bench_decode import decode_main

        return decode_main(args)
    if args.long:
        from kda.bench_long import long_main

        return long_main(args)
    calls = pick_impls(contenders(), args.impls)
    if calls is None:
        return 1
    report, copy_tbps, stem = report_header(
        (
            f"median of {TIMING_PASSES} passes over the contenders in turn, each the median of "
            "triton.testing.do_bench(warmup=25 ms, rep=100 ms); same inputs, same process; the SM clock "
            "during each pass from nvidia-smi (kda.clocks)"
        ),
        (
            "bf16 q,k,v,g,beta; K=V=128; lower-bound gate lb=-5, l2norm and beta sigmoid fused; fp32 state [N,H,V,K]; "
            "the precomputed-gate case: float32 g = -exp(A_log) softplus(g_raw + dt_bias), A_log = log U(1, 16), and "
            "float32 beta = sigmoid(b) applied outside (Kimi-Linear-48B's serving form)"
        ),
    )
    report.update(
        accuracy_vs_fp64=accuracy_rows(calls),
        host_overhead_tiny_call=host_overhead(calls),
        kernel_ms_1x8192_H96=kernel_split(calls, ANCHOR_CASES[0]),
        state_layout_ms_1x8192_H96=layout_cost(calls, ANCHOR_CASES[0]),
        cases=[],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = unused_stem(out / f"{stem}{args.tag}").name
    cases = ANCHOR_CASES[:2] if args.quick else ANCHOR_CASES
    if args.cases:
        cases = [ANCHOR_CASES[i] for i in args.cases]
    clocks = ClockSampler(torch.cuda.current_device())
    for case in cases:
        tensors, kw = make_inputs(case)
        row = {"case": case["name"], "floor_ms": floor_ms(floor_bytes(case), copy_tbps)}
        row["agreement"] = agreement(calls, tensors, kw)
        bad = disagreeing(row["agreement"])
        if bad:  # timed, but given no ratio: what was timed is wrong
            row["disagrees"] = bad
            print(f"  {case['name']}: {bad} off {AGREEMENT:g} of the others' outputs: {row['agreement']}", flush=True)
        timing = time_calls(calls, tensors, kw, clocks=clocks)
        row["ms"], row["first_call_s"], row["pass_ms"], row["pass_clocks"] = timing
        row["triton_configs"] = triton_configs()
        if "fla" in row["ms"]:
            row["ratio_to_fla"] = {n: t / row["ms"]["fla"] for n, t in row["ms"].items() if n not in bad}
            if case["name"] in FLASH_KDA_RATIO:
                row["flash_kda_ratio_anchor"] = FLASH_KDA_RATIO[case["name"]]
        report["cases"].append(row)
        print(case["name"], {n: round(t, 3) for n, t in row["ms"].items()}, flush=True)
        write_report(report, out / stem, markdown_table, plot)
    clocks.close()
    print(markdown_table(report))
    return 0


def unused_stem(path: Path) -> Path:
    """``path``, or ``path``-2, -3, ... : the first stem no results file has, so that a second run
    on one card model and day does not write over the first (it did until 2026-12-07)."""
    stem, n = path, 1
    while any((stem.parent / f"{stem.name}{ext}").exists() for ext in (".json", ".md", ".png")):
        n += 1
        stem = path.parent / f"{path.name}-{n}"
    return stem


def write_report(report: dict, path: Path, table, draw) -> None:
    """``path``.json, .md (``table(report)``) and .png (``draw``): written after every case, so
    that a run cut short still leaves its results (the callers take ``path`` from
    :func:`unused_stem` once per run)."""
    name = path.name  # not with_suffix: a --tag may hold a dot
    (path.parent / f"{name}.json").write_text(json.dumps(report, indent=1))
    (path.parent / f"{name}.md").write_text(table(report))
    draw(report, path.parent / f"{name}.png")


# Training (forward + backward): bf16, lower-bound gate, h0, a gradient into the final state too.
# The last case takes the softplus gate instead (Kimi Linear's): the kernels' unsafe-gate
# variants, with the pairwise path in a second launch (prepare.FAR_LAUNCHES).
TRAIN_CASES = [
    {"name": "1x8192 H32", "seq_lens": [8192], "H": 32},
    {"name": "1x8192 H64", "seq_lens": [8192], "H": 64},
    {"name": "1x8192 H96", "seq_lens": [8192], "H": 96},
    {"name": "varlen 4x4096 H32", "seq_lens": [4096] * 4, "H": 32},
    {"name": "1x8192 H32 softplus", "seq_lens": [8192], "H": 32, "gate": "softplus"},
]
TRAIN_TARGET = 0.8  # issue 11: fwd+bwd time <= 0.8x fla's (moonshot 0.6x), peak extra memory <= fla's
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def train_contenders() -> dict:
    """name -> callable(tensors, kwargs) -> (o, final_state), for the implementations with a
    backward: kda's Triton path, kda's CUDA path where it is built (its forward, saving the
    checkpoints, then Triton's backward) and fla's chunk_kda (FLA_FLASH_KDA=0)."""
    import kda
    import kda.cuda

    out = {"kda-triton": lambda t, kw: kda.chunk_kda(*t, backend="triton", **kw)}
    if kda.cuda.BACKEND.availability() is None:
        out["kda-cuda"] = lambda t, kw: kda.chunk_kda(*t, backend="cuda", **kw)
    if importlib.util.find_spec("fla") is not None:
        fla_own_kernels()
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        out["fla"] = lambda t, kw: fla_chunk_kda(*t, **kw)
    return out


def train_inputs(tensors: tuple, kw: dict, seed: int = 1) -> tuple[tuple, dict, list, tuple]:
    """Leaves that require grad (the five tensors, h0, A_log, dt_bias), the keyword arguments
    holding them, the leaves as a list, and random (do, dht) for o and the final state."""
    leaves = tuple(x.detach().clone().requires_grad_() for x in tensors)
    kw = dict(kw)
    for name in GRAD_NAMES[5:]:
        kw[name] = kw[name].detach().clone().requires_grad_()
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    B, T, _, _ = tensors[0].shape
    H, D = tensors[2].shape[2:]
    do = torch.randn(B, T, H, D, generator=gen, device=tensors[0].device).to(tensors[0].dtype)
    dht = torch.randn(kw["initial_state"].shape, generator=gen, device=tensors[0].device)
    return leaves, kw, [*leaves, *(kw[name] for name in GRAD_NAMES[5:])], (do, dht)


def fwd_bwd(call, leaves: tuple, kw: dict, grads_out: tuple) -> None:
    o, ht = call(leaves, kw)
    torch.autograd.backward([o, ht], list(grads_out))


def train_accuracy_rows(calls: dict) -> list[dict]:
    """Every gradient's relative RMS against float64 autograd of the token loop (on the GPU),
    bf16 inputs, the same inputs and output gradients for every implementation."""
    import kda
    from kda.reference import relative_rms

    rows = []
    for lens in ([1024], [512, 300, 777]):
        # H32, as TRAIN_CASES[0]: fla's autotuning (minutes per new head count) is shared
        tensors, kw = make_inputs({"seq_lens": lens, "H": 32}, seed=2)
        # fused_recurrent_kda takes neither (the gate is the same without safe_gate's promise)
        loop_kw = {n: v for n, v in kw.items() if n not in ("safe_gate", "cu_seqlens_cpu")}
        leaves, kw64, all64, (do, dht) = train_inputs(tuple(x.double() for x in tensors), float64_kw(loop_kw))
        o, ht = kda.fused_recurrent_kda(*leaves, backend="torch", **kw64)
        torch.autograd.backward([o, ht], [do.double(), dht.double()])
        ref = {name: x.grad for name, x in zip(GRAD_NAMES, all64)}
        for name, call in calls.items():
            leaves, kw_i, all_i, _ = train_inputs(tensors, kw)
            try:
                fwd_bwd(call, leaves, kw_i, (do, dht))
            except kda.BackendUnavailableError:  # (a case its backend refuses: none of these yet)
                continue
            row = {"case": f"lens {lens} H32", "impl": name}
            row.update({g: relative_rms(x.grad, ref[g]) for g, x in zip(GRAD_NAMES, all_i)})
            rows.append(row)
    return rows


def train_main(args) -> int:
    """``kda bench --train``: fwd+bwd time and peak extra memory of each implementation with a
    backward on TRAIN_CASES, the same inputs and output gradients, and the gradients' accuracy."""
    import triton.testing

    calls = pick_impls(train_contenders(), args.impls)
    if calls is None:
        return 1
    # (the header every bench report starts with; this one's was built here by hand until 2026-12-07)
    report, _, stem = report_header(
        timing="median of triton.testing.do_bench(warmup=25 ms, rep=100 ms, grads set to None each call)",
        inputs="bf16 q,k,v,g,beta; K=V=128; lower-bound gate lb=-5 (softplus where the case says) with A_log, "
        "dt_bias; l2norm and beta sigmoid fused; fp32 h0 [N,H,V,K]; loss = <o, do> + <final_state, dht>; "
        "every input requires grad",
    )
    report["grad_accuracy_vs_fp64"] = train_accuracy_rows(calls) if args.accuracy else []
    report["cases"] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = unused_stem(out / f"{stem}-train{args.tag}").name
    cases = [TRAIN_CASES[i] for i in args.cases] if args.cases else TRAIN_CASES
    import kda

    for case in cases:
        tensors, kw = make_inputs(case)
        row = {"case": case["name"], "fwd_ms": {}, "fwd_bwd_ms": {}, "peak_extra_GB": {}, "first_call_s": {},
               "kernel_ms": {}, "not_run": {}}  # fmt: skip
        for name, call in calls.items():
            leaves, kw_i, grad_leaves, grads_out = train_inputs(tensors, kw)
            start = time.perf_counter()
            try:
                fwd_bwd(call, leaves, kw_i, grads_out)
            except kda.BackendUnavailableError as refused:  # kda-cuda on the softplus gate
                row["not_run"][name] = str(refused)
                print(f"  {name}: not run: {refused}", flush=True)
                continue
            torch.cuda.synchronize()
            row["first_call_s"][name] = time.perf_counter() - start
            for x in grad_leaves:
                x.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(call, leaves, kw_i, grads_out)
            torch.cuda.synchronize()
            row["peak_extra_GB"][name] = (torch.cuda.max_memory_allocated() - base) / 1e9
            row["fwd_bwd_ms"][name] = triton.testing.do_bench(
                lambda: fwd_bwd(call, leaves, kw_i, grads_out), warmup=25, rep=100, grad_to_none=grad_leaves,
                return_mode="median",
            )  # fmt: skip
            row["fwd_ms"][name] = triton.testing.do_bench(
                lambda: call(leaves, kw_i), warmup=25, rep=100, return_mode="median"
            )
            if name.startswith("kda-"):
                row["kernel_ms"][name] = kernel_times(lambda: fwd_bwd(call, leaves, kw_i, grads_out), iters=5)
            print(f"  {name}: fwd+bwd {row['fwd_bwd_ms'][name]:.3f} ms, fwd {row['fwd_ms'][name]:.3f} ms, "
                  f"peak extra {row['peak_extra_GB'][name]:.2f} GB (first call {row['first_call_s'][name]:.1f} s)",
                  flush=True)  # fmt: skip
        if "fla" in calls:
            row["fwd_bwd_ratio_to_fla"] = {n: t / row["fwd_bwd_ms"]["fla"] for n, t in row["fwd_bwd_ms"].items()}
            row["memory_ratio_to_fla"] = {n: m / row["peak_extra_GB"]["fla"] for n, m in row["peak_extra_GB"].items()}
        report["cases"].append(row)
        print(case["name"], {n: round(t, 3) for n, t in row["fwd_bwd_ms"].items()}, flush=True)
        write_report(report, out / stem, train_markdown_table, train_plot)
    print(train_markdown_table(report))
    return 0


def _train_impls(report: dict) -> list[str]:
    """Every implementation timed on some case, in the order first timed."""
    return list(dict.fromkeys(n for row in report["cases"] for n in row["fwd_bwd_ms"]))


def train_markdown_table(report: dict) -> str:
    impls = _train_impls(report)
    others = [n for n in impls if n != "fla"]
    lines = [
        f"{report['gpu']}, {report['date']}, " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        "| case | " + " | ".join(f"{n} fwd+bwd ms" for n in impls) + " | "
        + " | ".join(f"{n} / fla" for n in others) + " | " + " | ".join(f"{n} fwd ms" for n in impls) + " | "
        + " | ".join(f"{n} peak extra GB" for n in impls) + " |",
        "|---|" + "---:|" * (3 * len(impls) + len(others)),
    ]  # fmt: skip
    for row in report["cases"]:
        ratios = row.get("fwd_bwd_ratio_to_fla", {})

        def cells_of(field, digits):
            return [f"{row[field][n]:.{digits}f}" if n in row[field] else "-" for n in impls]

        cells = cells_of("fwd_bwd_ms", 3) + [f"{ratios[n]:.3f}" if n in ratios else "-" for n in others]
        cells += cells_of("fwd_ms", 3) + cells_of("peak_extra_GB", 2)
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    lines += ["", "| per kernel, one fwd+bwd | impl | kernel | ms |", "|---|---|---|---:|"]
    for row in report["cases"]:
        for impl, kernels in row.get("kernel_ms", {}).items():
            lines += [f"| {row['case']} | {impl} | {kernel} | {ms:.3f} |" for kernel, ms in kernels.items()]
    for row in report["cases"]:
        lines += [f"\n{row['case']}, {impl} not run: {why}" for impl, why in row.get("not_run", {}).items()]
    lines += ["", "| gradient accuracy | impl | " + " | ".join(f"d{g}" for g in GRAD_NAMES) + " |",
              "|---|---|" + "---:|" * len(GRAD_NAMES)]  # fmt: skip
    for a in report["grad_accuracy_vs_fp64"]:
        lines.append(f"| {a['case']} | {a['impl']} | " + " | ".join(f"{a[g]:.2e}" for g in GRAD_NAMES) + " |")
    return "\n".join(lines) + "\n"


def _pyplot():
    """matplotlib's pyplot on the file backend, or None (said once) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'kda-kernels[bench]')")
        return None
    return plt


def bar_groups(impls: list, groups: int) -> tuple[float, list[list[float]]]:
    """``(width, x positions per implementation)`` of a grouped bar chart: ``groups`` groups at
    0, 1, ... with one bar of each implementation side by side, centred on the group."""
    width = 0.8 / max(len(impls), 1)
    return width, [[j + (i - (len(impls) - 1) / 2) * width for j in range(groups)] for i in range(len(impls))]


def train_plot(report: dict, path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    cases = [r["case"] for r in report["cases"]]
    impls = _train_impls(report)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    width, positions = bar_groups(impls, len(cases))
    for name, xs in zip(impls, positions):
        nan = float("nan")  # an implementation a case did not run: no bar
        ax_t.bar(xs, [r["fwd_bwd_ms"].get(name, nan) for r in report["cases"]], width, label=name)
        ax_m.bar(xs, [r["peak_extra_GB"].get(name, nan) for r in report["cases"]], width, label=name)
    for ax, label in ((ax_t, "fwd+bwd ms (median, do_bench)"), (ax_m, "peak extra memory, GB")):
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"KDA training step, {report['gpu']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(report: dict) -> str:
    impls = list(report["cases"][0]["ms"])
    lines = [
        f"{report['gpu']}, {report['date']}, " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        "| case | floor ms | " + " | ".join(f"{n} ms" for n in impls) + " | "
        + " | ".join(f"{n} / fla" for n in impls if n != "fla") + " | FlashKDA / fla (anchor) |",
        "|---|---:|" + "---:|" * (2 * len(impls) - (1 if "fla" in impls else 0)) + "---:|",
    ]  # fmt: skip
    for row in report["cases"]:
        ratios = row.get("ratio_to_fla", {})
        cells = [f"{row['ms'][n]:.3f}" for n in impls] + [
            f"{ratios[n]:.3f}" if n in ratios else "-" for n in impls if n != "fla"
        ]
        anchor = row.get("flash_kda_ratio_anchor")
        lines.append(
            f"| {row['case']} | {row['floor_ms']:.3f} | " + " | ".join(cells) + f" | {anchor if anchor else '-'} |"
        )
    lines += [f"\n{row['case']}: {', '.join(row['disagrees'])} not ratioed: their outputs on the timed inputs are "
              f"off the others' by more than {AGREEMENT:g} ({row['agreement']})" for row in report["cases"]
              if row.get("disagrees")]  # fmt: skip
    lines += clock_lines(report)
    lines += ["", "| accuracy case | impl | o rel RMS | final state rel RMS |", "|---|---|---:|---:|"]
    for a in report["accuracy_vs_fp64"]:
        lines.append(f"| {a['case']} | {a['impl']} | {a['o']:.2e} | {a['final_state']:.2e} |")
    if report.get("host_overhead_tiny_call"):
        header = "| tiny call (T=64, H=1) | eager host us, median of 5 means (min-max) | graph replay us |"
        lines += ["", header, "|---|---:|---:|"]
        for name, row in report["host_overhead_tiny_call"].items():
            graph = f"{row['graph_replay_us']:.1f}" if "graph_replay_us" in row else row.get("graph_error", "-")
            low, high = row.get("eager_host_us_min"), row.get("eager_host_us_max")
            spread = "" if low is None else f" ({low:.1f}-{high:.1f})"  # reports before commit 89af978 lack it
            lines.append(f"| {name} | {row['eager_host_us']:.1f}{spread} | {graph} |")
    if report.get("state_layout_ms_1x8192_H96"):
        lines += ["", "| 1x8192 H96, state layout | VK ms | KV ms |", "|---|---:|---:|"]
        for name, row in report["state_layout_ms_1x8192_H96"].items():
            lines.append(f"| {name} | {row['VK']:.3f} | {row['KV']:.3f} |")
    if report.get("kernel_ms_1x8192_H96"):
        lines += ["", "| 1x8192 H96, per kernel | kernel | ms per call |", "|---|---|---:|"]
        for name, times in report["kernel_ms_1x8192_H96"].items():
            lines += [f"| {name} | {kernel} | {ms:.3f} |" for kernel, ms in times.items()]
    return "\n".join(lines) + "\n"


def clock_lines(report: dict) -> list[str]:
    """Markdown of each case's passes with the GPU's SM clock and power-cap share during each
    (kda.clocks; nothing for reports without samples)."""
    rows = [r for r in report["cases"] if any(c for cs in r.get("pass_clocks", {}).values() for c in cs)]
    if not rows:
        return []
    lines = ["", "| case | impl | ms per pass | SM MHz per pass | samples under the power cap |"]
    lines.append("|---|---|---|---|---:|")
    for r in rows:
        for name, passes in r["pass_clocks"].items():
            ms = ", ".join(f"{t:.3f}" for t in r["pass_ms"][name])
            mhz = ", ".join("-" if c is None else f"{c['sm_mhz']:.0f}" for c in passes)
            sampled = [c for c in passes if c is not None]
            capped = sum(c["power_capped"] * c["samples"] for c in sampled) / max(sum(c["samples"] for c in sampled), 1)
            lines.append(f"| {r['case']} | {name} | {ms} | {mhz} | {capped:.0%} |")
    return lines


def plot(report: dict, path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    cases = [r["case"] for r in report["cases"]]
    impls = list(report["cases"][0]["ms"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width, positions = bar_groups(impls, len(cases))
    for name, xs in zip(impls, positions):
        ax.bar(xs, [r["ms"][name] for r in report["cases"]], width, label=name)
    ax.scatter(
        range(len(cases)),
        [r["floor_ms"] for r in report["cases"]],
        marker="_",
        s=600,
        c="k",
        label="memory floor",
        zorder=3,
    )
    ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right")
    ax.set_ylabel("ms (median, do_bench)")
    ax.set_title(f"KDA forward, {report['gpu']}, {report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
