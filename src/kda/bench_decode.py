"""``kda bench --decode``: decode steps (issue 12's cases) beside fla's ``fused_recurrent_kda``,
same inputs, same process: CUDA-graph replay and eager, float32 and bfloat16 states, a plain
call (``initial_state`` -> a new float32 final state, fla's only kind; kda's bfloat16
write-back timed apart) and a state pool updated in place (slots in reverse order, and in a random
one), each with its
floor (state bytes read and written over the measured copy bandwidth); the decode kernel's
launch shapes swept; where chunk_kda should switch from its chunk stages to the decode
kernel; the accuracy of both against the float64 token loop.

Shapes: H = 32, K = V = 128, one token per sequence (N = 1, 32, 256, 1024), bf16 inputs, the
lower-bound gate (lb = -5), l2norm and beta sigmoid in the kernel, states [N, H, K, V] (fla's
default layout)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from kda.bench import fla_own_kernels, float64_kw, floor_ms, report_header, unused_stem, write_report
from kda.clocks import ClockSampler

DECODE_SEQUENCES = (1, 32, 256, 1024)
DECODE_HEADS = 32
D = 128
# issue 12's bars: graph replay N=1 no slower than fla, N >= 32 <= 0.8x fla, N >= 256 at
# least 90% of the copy bandwidth on the state bytes
TARGET_RATIO = 0.8
TARGET_BANDWIDTH = 0.9
CROSSOVER_TOKENS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_BLOCK_V = (8, 16, 32, 64, 128)
SWEEP_WARPS = (1, 2, 4)
SWEEP_STREAM = (False, True)  # the decode kernel's cache hints (decode.DECODE_STREAM)


def cuda_built() -> bool:
    """Whether kda's CUDA backend (and so its decode kernel) is available here."""
    import kda

    return any(b.name == "cuda" and b.available for b in kda.backends())


def decode_inputs(N: int, T: int = 1, state_dtype=torch.float32, seed: int = 0, H: int = DECODE_HEADS):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    tensors = (randn(N, T, H, D), randn(N, T, H, D), randn(N, T, H, D), randn(N, T, H, D), randn(N, T, H))
    kw = dict(
        A_log=torch.rand(H, generator=gen, device="cuda"),
        dt_bias=torch.rand(H * D, generator=gen, device="cuda"),
        initial_state=randn(N, H, D, D, dtype=state_dtype),
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=-5.0,
    )
    return tensors, kw


def state_bytes(N: int, state_dtype, H: int = DECODE_HEADS, written=None) -> int:
    """A decode step must read every state and write it back (in ``written``, default the
    state's dtype: a plain call's new final state is float32 unless final_state_dtype says)."""
    size = torch.tensor([], dtype=state_dtype).element_size()
    out = size if written is None else torch.tensor([], dtype=written).element_size()
    return N * H * D * D * (size + out)


def graph_ms(fn, spans: list | None = None) -> float:
    """Median of do_bench over replays of ``fn`` captured once (eager warm-up first); ``spans``:
    a list that gets the host times ``(t0, t1)`` around the replays' timing alone (not the
    warm-up and capture, where compiles happen), for the GPU clock's window."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm on the capture stream too
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t0 = time.time()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    if spans is not None:
        spans.append((t0, time.time()))
    return ms


def eager_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def contenders(mode: str) -> dict:
    """name -> callable(tensors, kw) for a plain call or a pool (``mode``: see :func:`slot_order`)."""
    import kda

    order = slot_order(mode)
    pool = order is not None

    def kda_call(t, kw, backend="auto"):
        with torch.inference_mode():  # as fla's, below: every contender in one grad mode
            if pool:
                N = t[0].shape[0]
                return kda.fused_recurrent_kda(*t, **kw, inplace_final_state=True,
                                               ssm_state_indices=kw_indices(N, order), backend=backend)  # fmt: skip
            return kda.fused_recurrent_kda(*t, **kw, output_final_state=True, backend=backend)

    calls = {"kda": kda_call}  # auto: the CUDA decode kernel where built, else Triton's
    if cuda_built():
        calls["kda_triton"] = lambda t, kw: kda_call(t, kw, backend="triton")
    if importlib.util.find_spec("fla") is not None:
        fla_own_kernels()
        from fla.ops.kda import fused_recurrent_kda as fla_decode
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_pooled  # serving engines' entry

        def fla_call(t, kw):
            with torch.inference_mode():
                if pool:
                    N = t[0].shape[0]
                    return fla_pooled(*t, **kw, inplace_final_state=True, ssm_state_indices=kw_indices(N, order))
                return fla_decode(*t, **kw, output_final_state=True)

        calls["fla"] = fla_call
    return calls


# The bench's pool rows: sequence n in slot N - 1 - n ("pool": the slots are not in sequence
# order, but a CTA's neighbours still read neighbouring slots), and a fixed random permutation of
# the N slots ("pool_random"), as a serving engine's pool holds requests that came and went. On an
# H100 (2026-12-07, run 208, benchmarks/pool_order.py, bf16 whole heads at N=256) random slots took
# 0.1945 ms against 0.1907 reversed; fla was not timed with them until this row.
POOL_MODES = ("pool", "pool_random")
SLOT_ORDERS = ("reversed", "ascending", "random")
PLAIN_MODES = ("plain", "plain_f32")  # (decode_problem: the final state in the state's dtype, or float32)
_INDICES: dict[tuple[int, str, str], torch.Tensor] = {}


def slot_order(mode: str) -> str | None:
    """A decode mode's slot order: None for a plain call (PLAIN_MODES), "reversed" for "pool", and
    ORDER for "pool_ORDER" (ORDER one of SLOT_ORDERS); any other name is refused."""
    if mode in PLAIN_MODES:
        return None
    order = "reversed" if mode == "pool" else mode.removeprefix("pool_") if mode.startswith("pool_") else None
    if order not in SLOT_ORDERS:
        raise ValueError(f"unknown decode mode {mode!r}: one of {PLAIN_MODES}, 'pool' or 'pool_' + {SLOT_ORDERS}")
    return order


def kw_indices(N: int, order: str = "reversed", device: str = "cuda") -> torch.Tensor:
    """The N sequences' int32 slots in a pool of N, in one of SLOT_ORDERS (made once, reused)."""
    if order not in SLOT_ORDERS:
        raise ValueError(f"order must be one of {SLOT_ORDERS}, got {order!r}")
    key = (N, order, device)
    if key not in _INDICES:
        if order == "random":
            slots = torch.randperm(N, generator=torch.Generator().manual_seed(0))
        else:
            slots = torch.arange(N) if order == "ascending" else torch.arange(N - 1, -1, -1)
        _INDICES[key] = slots.to(device, torch.int32)
    return _INDICES[key]


def accuracy(calls: dict, N: int = 32) -> dict:
    """Relative RMS of o and the final state against the float64 token loop (on the GPU)."""
    import kda
    from kda.reference import relative_rms

    t, kw = decode_inputs(N, T=4, seed=7)
    t64 = [x.double() for x in t]
    o_ref, ht_ref = kda.fused_recurrent_kda(*t64, **float64_kw(kw), output_final_state=True, backend="torch")
    out = {}
    for name, call in contenders("plain").items():
        o, ht = call(t, kw)
        out[name] = {"o": relative_rms(o, o_ref), "state": relative_rms(ht, ht_ref)}
    return out


def sweep(N: int) -> dict:
    """The decode kernel's graph-replay time at each (block_v, num_warps, cache hints), plain
    call, fp32."""
    import kda
    from kda.api import checked_problem
    from kda.triton.decode import decode

    t, kw = decode_inputs(N)
    p = checked_problem(kda.fused_recurrent_kda, *t, **kw, output_final_state=True)
    out = {}
    for bv in SWEEP_BLOCK_V:
        for warps in SWEEP_WARPS:
            for stream in SWEEP_STREAM:
                name = f"BV{bv}-w{warps}" + ("-stream" if stream else "")
                try:
                    out[name] = graph_ms(lambda bv=bv, w=warps, s=stream: decode(p, block_v=bv, num_warps=w, stream=s))
                except Exception as e:  # noqa: BLE001 - a shape that does not compile is a result too
                    out[name] = f"{type(e).__name__}"
    return out


def decode_problem(N: int, state_dtype, mode: str):
    """The CUDA decode kernel's problem on :func:`decode_inputs`: a plain call (``initial_state``
    -> a new final state in ``state_dtype``; "plain_f32": in float32) or a pool updated in place
    (``mode``, its slots by :func:`slot_order`), fresh each call."""
    import kda
    from kda.api import checked_problem
    from kda.validation import check_pool

    order = slot_order(mode)
    t, kw = decode_inputs(N, state_dtype=state_dtype)
    if order is None:
        final = torch.float32 if mode == "plain_f32" else state_dtype
        return checked_problem(kda.fused_recurrent_kda, *t, **kw, output_final_state=True, final_state_dtype=final)
    kw_pool = {name: x for name, x in kw.items() if name != "initial_state"}
    slots = kw_indices(N, order)
    return check_pool(checked_problem(kda.fused_recurrent_kda, *t, **kw_pool), kw["initial_state"], slots, None)


def cuda_sweep(N: int) -> dict:
    """The CUDA decode kernel's graph-replay time at each CTA width, plain call and pool, both
    state dtypes (columns -> ms)."""
    from kda import abi
    from kda.cuda.decode import decode

    out = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        for mode in ("plain", "pool") if state_dtype == torch.float32 else ("plain", "plain_f32", "pool"):
            p = decode_problem(N, state_dtype, mode)
            for columns in abi.DECODE_COLUMNS:
                name = f"{str(state_dtype).removeprefix('torch.')}-{mode}-c{columns}"
                out[name] = graph_ms(lambda p=p, c=columns: decode(p, c))
    return out


def layouts(N: int) -> dict:
    """kda's decode step (plain call, fp32, default launch, graph replay) with the state in
    fla's [N, H, K, V] layout and in [N, H, V, K] (``state_v_first``: a program's V rows
    of K values are one contiguous run, where the K-first layout gives it BV values per row)."""
    import kda

    t, kw = decode_inputs(N)
    out = {"k_first_ms": graph_ms(lambda: kda.fused_recurrent_kda(*t, **kw, output_final_state=True))}
    kw_v = {**kw, "initial_state": kw["initial_state"].transpose(-1, -2).contiguous(), "state_v_first": True}
    out["v_first_ms"] = graph_ms(lambda: kda.fused_recurrent_kda(*t, **kw_v, output_final_state=True))
    return out


def crossover(N: int = 32) -> list[dict]:
    """chunk_kda's stages against the decode kernel at T tokens per sequence (graph replay)."""
    import kda
    from kda.api import checked_problem
    from kda.triton import chunk_forward
    from kda.triton.decode import decode

    rows = []
    for T in CROSSOVER_TOKENS:
        t, kw = decode_inputs(N, T=T)
        p = checked_problem(kda.chunk_kda, *t, **kw, output_final_state=True)
        row = {"T": T, "decode": graph_ms(lambda p=p: decode(p))}
        row["triton_chunks"] = graph_ms(lambda p=p: chunk_forward(p))
        if cuda_built():
            row["cuda_chunks"] = graph_ms(lambda t=t, kw=kw: kda.chunk_kda(*t, **kw, output_final_state=True,
                                                                           backend="cuda"))  # fmt: skip
        rows.append(row)
        print("crossover", row, flush=True)
    return rows


PREFILL_SEQUENCES = 32  # sequences per prefill call, lengths drawn anew for every call
PREFILL_LONGEST = 512
PREFILL_LAYOUTS = 16  # layouts cycled through, one per call


def prefill_inputs(seed: int = 3):
    """``(layouts, tensors, kw)`` of the serving prefill: PREFILL_LAYOUTS pairs of ``cu_seqlens``
    (device, host) and inputs long enough for the longest layout (``x[:, :cu[-1]]`` of each)."""
    gen = torch.Generator().manual_seed(seed)
    layouts = []
    for _ in range(PREFILL_LAYOUTS):
        lengths = torch.randint(1, PREFILL_LONGEST + 1, (PREFILL_SEQUENCES,), generator=gen)
        host = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        layouts.append((host.cuda(), host))
    most = max(int(h[-1]) for _, h in layouts)
    t, kw = decode_inputs(1, T=most, seed=seed)
    kw["initial_state"] = kw["initial_state"].expand(PREFILL_SEQUENCES, -1, -1, -1).contiguous()
    return layouts, t, kw


def prefill(seed: int = 3) -> dict:
    """The serving prefill: varlen calls whose lengths change on every call (cycling through
    PREFILL_LAYOUTS layouts of PREFILL_SEQUENCES sequences, 1 to PREFILL_LONGEST tokens each),
    ``cu_seqlens`` on the device with its host copy. Per contender: the eager time per call (the
    host's share included: nothing is replayed), the host time alone (calls issued back to
    back, no wait), and whether a call synchronised (torch's sync debug mode set to error)."""
    import triton.testing

    import kda

    layouts, t, kw = prefill_inputs(seed)
    calls = {"kda": kda.chunk_kda}
    if importlib.util.find_spec("fla") is not None:
        fla_own_kernels()
        from fla.ops.kda import chunk_kda as fla_chunk

        calls["fla"] = fla_chunk
    out = {"sequences": PREFILL_SEQUENCES, "longest": PREFILL_LONGEST, "layouts": PREFILL_LAYOUTS,
           "mean_tokens": sum(int(h[-1]) for _, h in layouts) / PREFILL_LAYOUTS}  # fmt: skip
    for name, fn in calls.items():
        turn = [0]

        def step(fn=fn, turn=turn):
            cu, host = layouts[turn[0] % PREFILL_LAYOUTS]
            turn[0] += 1
            n = int(host[-1])
            with torch.inference_mode():
                return fn(*(x[:, :n] for x in t), **kw, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=host)

        for _ in range(2 * PREFILL_LAYOUTS):  # compile and tune every layout's shapes first
            step()
        torch.cuda.synchronize()
        row = {"eager_ms": triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")}
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(PREFILL_LAYOUTS):
            step()
        row["host_ms"] = (time.perf_counter() - start) / PREFILL_LAYOUTS * 1e3
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(PREFILL_LAYOUTS):
                step()
            row["host_sync"] = "none"
        except RuntimeError as e:
            row["host_sync"] = str(e).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[name] = row
    if "fla" in out:
        out["ratio_eager"] = out["kda"]["eager_ms"] / out["fla"]["eager_ms"]
    print("prefill", out, flush=True)
    return out


def decode_cases(report: dict, clocks: ClockSampler, copy_tbps: float, path: Path) -> None:
    """Issue 12's cases, each contender beside fla, into ``report["cases"]`` (the report written
    to ``path`` after each), with the GPU's clock over each graph timing (``clocks``)."""
    import kda

    for state_dtype in (torch.float32, torch.bfloat16):
        for mode in ("plain", *POOL_MODES):
            calls = contenders(mode)
            for N in DECODE_SEQUENCES:
                t, kw = decode_inputs(N, state_dtype=state_dtype)
                # Every contender the same call: a plain call writes a float32 final state (fla's
                # only kind, kda's default). Until 2026-12-07 kda alone wrote bf16 states back in
                # the bf16 plain rows, a third fewer bytes than fla (a review of the bench): its
                # bf16 write-back is timed apart, below, beside its own floor.
                written = torch.float32 if mode == "plain" else state_dtype
                floor = floor_ms(state_bytes(N, state_dtype, written=written), copy_tbps)
                row = {"N": N, "state": str(state_dtype).removeprefix("torch."), "mode": mode, "floor_ms": floor}
                # The same bytes as one copy of the states, replayed the same way: the floor at
                # this size, launch and ramp included (the floor above is a 2 GB copy's rate)
                src = kw["initial_state"]
                dst = torch.empty(src.shape, dtype=written, device=src.device)
                row["state_copy_graph_ms"] = graph_ms(lambda src=src, dst=dst: dst.copy_(src))
                spans = {name: [] for name in calls}  # each contender's graph timing, for its clock
                for name, call in calls.items():
                    try:
                        row[f"{name}_graph_ms"] = graph_ms(lambda call=call: call(t, kw), spans[name])
                        row[f"{name}_eager_ms"] = eager_ms(lambda call=call: call(t, kw))
                    except Exception as e:  # noqa: BLE001 - fla's kernel may refuse a layout: say so
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
                if mode == "plain" and state_dtype == torch.bfloat16:  # kda's bf16 write-back (no fla twin)
                    kw16 = {**kw, "final_state_dtype": torch.bfloat16}
                    row["kda_bf16_out_graph_ms"] = graph_ms(lambda: calls["kda"](t, kw16))
                    row["kda_bf16_out_bandwidth_fraction"] = (
                        floor_ms(state_bytes(N, state_dtype), copy_tbps) / row["kda_bf16_out_graph_ms"]
                    )
                timed = [name for name in calls if spans[name]]
                for name, clock in zip(timed, clocks.windows([spans[name][0] for name in timed])):
                    row[f"{name}_graph_clock"] = clock
                if "fla_graph_ms" in row and "kda_graph_ms" in row:
                    row["ratio_graph"] = row["kda_graph_ms"] / row["fla_graph_ms"]
                if "fla_graph_ms" in row and "kda_triton_graph_ms" in row:
                    row["ratio_triton_graph"] = row["kda_triton_graph_ms"] / row["fla_graph_ms"]
                with kda.record_dispatch() as events:
                    calls["kda"](t, kw)
                row["kda_ran"] = ",".join(e for e in events if ":" in e)
                for name in calls:
                    if f"{name}_graph_ms" in row:
                        row[f"{name}_bandwidth_fraction"] = floor / row[f"{name}_graph_ms"]
                report["cases"].append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                write_report(report, path, markdown_table, lambda r, p: None)


def decode_main(args) -> int:
    report, copy_tbps, stem = report_header(
        "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms); graph: replays of one capture",
        __doc__.split("Shapes: ")[1].strip(),
    )
    report["accuracy_vs_fp64_N32_T4"] = accuracy(contenders("plain"))
    report["cases"] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = unused_stem(out / f"{stem}-decode{args.tag}").name
    with ClockSampler(torch.cuda.current_device()) as clocks:
        decode_cases(report, clocks, copy_tbps, out / stem)
    report["prefill_varlen"] = prefill()
    report["layouts_fp32_plain"] = {N: layouts(N) for N in DECODE_SEQUENCES}
    print("layouts", report["layouts_fp32_plain"], flush=True)
    if cuda_built():
        report["cuda_sweep"] = {N: cuda_sweep(N) for N in DECODE_SEQUENCES}
        print("cuda sweep", report["cuda_sweep"], flush=True)
    if not args.quick:  # --quick: the cases alone
        report["sweep_fp32_plain"] = {N: sweep(N) for N in DECODE_SEQUENCES}
        print("sweep", report["sweep_fp32_plain"], flush=True)
        report["crossover_N32"] = crossover()
    write_report(report, out / stem, markdown_table, lambda r, p: None)
    print(markdown_table(report))
    return 0


def clock_lines(report: dict) -> list[str]:
    """Markdown of the SM clock and power-cap share during each contender's graph timing
    (kda.clocks; nothing for reports without samples)."""
    rows = []
    for r in report["cases"]:
        for key, c in r.items():
            if key.endswith("_graph_clock") and c is not None:
                name = key.removesuffix("_graph_clock")
                rows.append(f"| {r['state']} | {r['mode']} | {r['N']} | {name} | {r[f'{name}_graph_ms']:.4f} "
                            f"| {c['sm_mhz']:.0f} | {c['power_capped']:.0%} |")  # fmt: skip
    if not rows:
        return []
    return ["", "| state | mode | N | impl | graph ms | SM MHz | samples under the power cap |",
            "|---|---|---:|---|---:|---:|---:|", *rows]  # fmt: skip


def bf16_out_fraction(row: dict) -> str:
    fraction = row.get("kda_bf16_out_bandwidth_fraction")
    return "" if fraction is None else f" ({fraction:.2f})"


def markdown_table(report: dict) -> str:
    lines = [
        f"# Decode, {report['gpu']}, {report['date']}",
        "",
        f"{report['timing']}. Copy bandwidth {report['measured_copy_TBps']:.2f} TB/s. Inputs: {report['inputs']}",
        f"Versions: {report['versions']}",
        "",
        "| state | mode | N | floor ms | state copy ms | kda graph ms | fla graph ms | kda / fla | kda BW frac "
        "| fla BW frac | kda eager ms | fla eager ms | kda ran | kda triton graph ms | triton / fla "
        "| kda bf16 write-back graph ms (BW frac) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]

    def f(row, key, fmt="{:.4f}"):
        return fmt.format(row[key]) if isinstance(row.get(key), float) else row.get(key, "-")

    for r in report["cases"]:
        lines.append(
            f"| {r['state']} | {r['mode']} | {r['N']} | {f(r, 'floor_ms')} | {f(r, 'state_copy_graph_ms')} "
            f"| {f(r, 'kda_graph_ms')} "
            f"| {f(r, 'fla_graph_ms')} | {f(r, 'ratio_graph', '{:.3f}')} | {f(r, 'kda_bandwidth_fraction', '{:.2f}')} "
            f"| {f(r, 'fla_bandwidth_fraction', '{:.2f}')} | {f(r, 'kda_eager_ms')} | {f(r, 'fla_eager_ms')} "
            f"| {r.get('kda_ran', '-')} | {f(r, 'kda_triton_graph_ms')} | {f(r, 'ratio_triton_graph', '{:.3f}')} "
            f"| {f(r, 'kda_bf16_out_graph_ms')}{bf16_out_fraction(r)} |"
        )
    lines += clock_lines(report)
    acc = report.get("accuracy_vs_fp64_N32_T4", {})
    if acc:
        lines += ["", "Accuracy against the float64 token loop (N=32, T=4): "
                  + ", ".join(f"{n}: o {a['o']:.2e}, state {a['state']:.2e}" for n, a in acc.items())]  # fmt: skip
    pre = report.get("prefill_varlen")
    if pre:
        lines += ["", f"Varlen prefill, {pre['sequences']} sequences of 1-{pre['longest']} tokens drawn anew per call "
                  f"(mean {pre['mean_tokens']:.0f} tokens), eager: "
                  + "; ".join(f"{n} {pre[n]['eager_ms']:.4f} ms per call, host {pre[n]['host_ms']:.4f} ms, "
                              f"syncs: {pre[n]['host_sync']}" for n in ("kda", "fla") if n in pre)]  # fmt: skip
    sweep_cuda = report.get("cuda_sweep")
    if sweep_cuda:
        lines += ["", "CUDA decode kernel by CTA width (graph ms): " + "; ".join(
            f"N={n}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()) for n, r in sweep_cuda.items())]  # fmt: skip
    lay = report.get("layouts_fp32_plain")
    if lay:
        lines += ["", "kda, fp32 plain, state layout (graph ms, [N,H,K,V] / [N,H,V,K]): " + "; ".join(
            f"N={n}: {r['k_first_ms']:.4f} / {r['v_first_ms']:.4f}" for n, r in lay.items())]  # fmt: skip
    if "crossover_N32" in report:
        steps = ["T={}: {}".format(r["T"], ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k != "T"))
                 for r in report["crossover_N32"]]  # fmt: skip
        lines += ["", "chunk_kda crossover (N=32, graph ms): " + "; ".join(steps)]
    return "\n".join(lines) + "\n"
