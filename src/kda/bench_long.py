"""``kda bench --long``: long single sequences (issue 13's cases) beside fla's ``chunk_kda``,
same inputs, same process, each with its floor; kda's CUDA path as dispatched (``kda-cuda``:
split automatically where ``kda.segments.auto_span`` says), uncut (``KDA_SEGMENT_TOKENS=0``)
and split at several lengths (``KDA_SEGMENT_TOKENS``, ``kda.segments``), and how far each split's
outputs and final state move from the uncut call's, on the same inputs with the raw gate
lowered by SPLIT_CHECK_GATE_SHIFT (the timed inputs' decays, exp(-2.5) a token or so, forget a
segment's entering state within a few tokens: there the split and the uncut call agree bit for bit,
which checks nothing; H200, 2026-12-01, run 18).

Inputs as ``kda bench`` (kda.bench.make_inputs): bf16, K = V = 128, the lower-bound gate,
l2norm and beta sigmoid in the kernel, fp32 states [N, H, V, K]. fla may autotune for minutes
on a head count it has not met (the device scripts carry its cache, one a card: benchmarks/autotune_cache.sh)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kda.bench import (
    _pyplot,
    bar_groups,
    contenders,
    floor_bytes,
    floor_ms,
    make_inputs,
    report_header,
    unused_stem,
    write_report,
)
from kda.clocks import ClockSampler
from kda.segments import SETTING

LONG_CASES = [
    {"name": "1x32768 H32", "seq_lens": [32768], "H": 32},
    {"name": "1x131072 H32", "seq_lens": [131072], "H": 32},
    {"name": "1x524288 H16", "seq_lens": [524288], "H": 16},
    {"name": "1x2097152 H8", "seq_lens": [2097152], "H": 8},
    # the automatic split's rule (kda.segments.auto_span) on shorter sequences of few heads
    {"name": "1x131072 H8", "seq_lens": [131072], "H": 8},
    {"name": "1x524288 H8", "seq_lens": [524288], "H": 8},
]
# issue 13's bars, as ratios to fla's time
TARGET_RATIO = {"1x32768 H32": 0.30, "1x131072 H32": 0.30, "1x2097152 H8": 0.25}
SEGMENT_TOKENS = (8192, 16384, 32768, 65536)  # the split's lengths timed beside the uncut call (segments.AUTO_SPANS)
REP_MS = 1000  # do_bench's measuring time: a long call takes up to ~100 ms
# The split's check: the raw gate lowered by this much, decays of exp(-lb sigmoid(-e^A (6 - x))) a
# token, 1e-2 to 1e-7 in the exponent, so that the state entering a segment carries through it.
SPLIT_CHECK_GATE_SHIFT = 6.0


def timed(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=REP_MS, return_mode="median")


def timed_in_turn(calls: dict, tensors, kw: dict, variants: list, label: str = "") -> list[dict]:
    """The whole call under each ``(name, apply)`` of ``variants`` in turn (benchmarks' A/Bs in one
    process): ``apply()`` sets the variant up, then kda-cuda runs once and is timed; ``apply`` None
    times fla. Rows ``{"name", "ms"}``, each printed as it lands."""
    rows = []
    with torch.inference_mode():
        for name, apply in variants:
            if apply is not None:
                apply()
            call = calls["fla" if apply is None else "kda-cuda"]
            call(tensors, kw)
            torch.cuda.synchronize()
            rows.append({"name": name, "ms": timed(lambda call=call: call(tensors, kw))})
            print(f"{label}whole call, {name}: {rows[-1]['ms']:.3f} ms", flush=True)
    return rows


def with_segments(tokens: int, fn):
    """``fn`` run with KDA_SEGMENT_TOKENS set to ``tokens`` (read by every call), then restored."""

    def run():
        before = os.environ.get(SETTING)
        os.environ[SETTING] = str(tokens)
        try:
            return fn()
        finally:
            if before is None:
                os.environ.pop(SETTING, None)
            else:
                os.environ[SETTING] = before

    return run


def fits(row: dict, name: str, fn) -> bool:
    """``fn()``, or, where the card cannot hold it, ``name`` and the error's first line into
    ``row["out_of_memory"]`` (the row's other variants go on) and False."""
    try:
        fn()
        return True
    except torch.OutOfMemoryError as error:
        row.setdefault("out_of_memory", {})[name] = str(error).split("\n")[0][:160]
        print(f"  {row['case']} {name}: out of memory", flush=True)
        torch.cuda.empty_cache()
        return False


def split_rows(call, tensors, kw: dict, row: dict) -> None:
    """Into ``row``: ``call`` (kda-cuda) timed uncut and split at each of SEGMENT_TOKENS (``ms``),
    and each split's outputs and final state against the uncut call's on the check's inputs
    (``split_vs_uncut``). A variant the card cannot hold goes to ``out_of_memory`` with what
    it was, and the others go on: run 147 (2026-12-05, an 80 GB H100) lost the 2M-token case's
    whole row to one. The check's distances are float64 sums over slices
    (reference.relative_rms), not whole float64 copies."""
    from kda.reference import relative_rms

    def time_as(name: str, tokens: int) -> None:
        row["ms"][name] = timed(with_segments(tokens, lambda: call(tensors, kw)))
        print(f"  {row['case']} {name}: {row['ms'][name]:.3f} ms", flush=True)

    fits(row, "kda-cuda-uncut", lambda: time_as("kda-cuda-uncut", 0))
    q, k, v, g, beta = tensors
    slow = (q, k, v, g - SPLIT_CHECK_GATE_SHIFT, beta)  # long memory: the check's inputs
    uncut = []
    if not fits(row, "uncut (check)", lambda: uncut.extend(with_segments(0, lambda: call(slow, kw))())):
        return
    row["split_vs_uncut"] = {}

    def check(name: str, tokens: int) -> None:
        o, s = with_segments(tokens, lambda: call(slow, kw))()
        row["split_vs_uncut"][name] = {"o": relative_rms(o, uncut[0]), "state": relative_rms(s, uncut[1])}
        print(f"  {row['case']} {name}: {row['split_vs_uncut'][name]}", flush=True)

    for tokens in SEGMENT_TOKENS:
        name = f"kda-cuda-seg{tokens}"
        if fits(row, name, lambda: time_as(name, tokens)):
            fits(row, f"{name} (check)", lambda: check(name, tokens))


def long_main(args) -> int:
    from kda.bench import pick_impls

    calls = pick_impls(contenders(), args.impls)
    if calls is None:
        return 2
    # --impls times only the contenders named: no uncut and split rows beside them (a session's
    # figures against fla at 2M tokens, without ten more timed variants; run 83, 2026-12-04)
    splits = not args.impls
    report, copy_tbps, stem = report_header(
        f"median of triton.testing.do_bench (warmup 25 ms, rep {REP_MS} ms), same inputs, same process",
        __doc__.split("Inputs as ")[1].split(" fla may")[0].strip(),
    )
    report["cases"] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = unused_stem(out / f"{stem}-long{args.tag}").name
    cases = LONG_CASES[:2] if args.quick else LONG_CASES
    if args.cases:  # as the other benches: 0-based numbers
        cases = [LONG_CASES[i] for i in args.cases]
    clocks = ClockSampler(torch.cuda.current_device())
    for case in cases:
        tensors, kw = make_inputs(case)
        row = {"case": case["name"], "floor_ms": floor_ms(floor_bytes(case), copy_tbps), "ms": {}, "clocks": {}}
        with torch.inference_mode():
            for name, call in calls.items():
                t0 = time.time()

                def time_call(name=name, call=call):
                    row["ms"][name] = timed(lambda: call(tensors, kw))

                if not fits(row, name, time_call):  # a contender whose buffers the card cannot hold
                    continue
                (row["clocks"][name],) = clocks.windows([(t0, time.time())])  # with its last period's sample
                mhz = "-" if row["clocks"][name] is None else f"{row['clocks'][name]['sm_mhz']:.0f}"
                print(f"  {case['name']} {name}: {row['ms'][name]:.3f} ms (SM {mhz} MHz)", flush=True)
            if splits and "kda-cuda" in calls:  # kda-cuda as dispatched (split where it applies), and uncut
                split_rows(calls["kda-cuda"], tensors, kw, row)
        if "fla" in row["ms"]:
            row["ratio_to_fla"] = {n: t / row["ms"]["fla"] for n, t in row["ms"].items()}
            row["target_ratio"] = TARGET_RATIO.get(case["name"])
        report["cases"].append(row)
        write_report(report, out / stem, markdown_table, plot)
    clocks.close()
    print(markdown_table(report))
    return 0


def markdown_table(report: dict) -> str:
    names = sorted({n for r in report["cases"] for n in r["ms"]})
    lines = [
        f"# Long sequences, {report['gpu']}, {report['date']}",
        "",
        f"{report['timing']}. Copy bandwidth {report['measured_copy_TBps']:.2f} TB/s. Inputs: {report['inputs']}",
        f"Versions: {report['versions']}",
        "",
        "| case | floor ms | " + " | ".join(f"{n} ms (/ fla)" for n in names) + " | bar |",
        "|---|---:|" + "---:|" * len(names) + "---:|",
    ]
    for r in report["cases"]:
        cells = []
        for n in names:
            t, ratio = r["ms"].get(n), r.get("ratio_to_fla", {}).get(n)
            cells.append("-" if t is None else f"{t:.3f}" + (f" ({ratio:.3f})" if ratio is not None else ""))
        bar = r.get("target_ratio")
        lines.append(f"| {r['case']} | {r['floor_ms']:.3f} | " + " | ".join(cells) + f" | {bar or '-'} |")
    moved = [f"{r['case']} {n}: o {d['o']:.1e}, state {d['state']:.1e}" for r in report["cases"]
             for n, d in r.get("split_vs_uncut", {}).items()]  # fmt: skip
    if moved:
        head = f"Split against the uncut CUDA call (relative RMS; raw gate lowered by {SPLIT_CHECK_GATE_SHIFT}): "
        lines += ["", head + "; ".join(moved)]
    short = [f"{r['case']} {n} ({why})" for r in report["cases"] for n, why in r.get("out_of_memory", {}).items()]
    if short:
        lines += ["", "Out of memory on this card, not run: " + "; ".join(short)]
    clocked = [f"{r['case']} {n} {c['sm_mhz']:.0f} MHz ({c['power_capped']:.0%} under the power cap)"
               for r in report["cases"] for n, c in r.get("clocks", {}).items() if c]  # fmt: skip
    if clocked:
        lines += ["", "SM clock while timed (nvidia-smi, kda.clocks): " + "; ".join(clocked)]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Each contender's time as a share of fla's, case by case (the long cases' times span
    6-100 ms, so ratios rather than times), with issue 13's bar and the memory floor's share."""
    plt = _pyplot()
    rows = [r for r in report["cases"] if "ratio_to_fla" in r]
    if plt is None or not rows:
        return
    impls = sorted({n for r in rows for n in r["ratio_to_fla"] if n != "fla"})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width, positions = bar_groups(impls, len(rows))
    for name, xs in zip(impls, positions):  # a contender a case did not run: no bar
        ax.bar(xs, [r["ratio_to_fla"].get(name, float("nan")) for r in rows], width, label=name)
    ax.scatter(range(len(rows)), [r["floor_ms"] / r["ms"]["fla"] for r in rows], marker="_", s=600, c="k",
               label="memory floor", zorder=3)  # fmt: skip
    bars = [(j, r["target_ratio"]) for j, r in enumerate(rows) if r.get("target_ratio")]
    if bars:
        ax.scatter(*zip(*bars), marker="_", s=600, c="tab:red", label="issue 13's bar", zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("time / fla's (median, do_bench)")
    ax.set_title(f"KDA forward, long sequences, {report['gpu']}, {report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
