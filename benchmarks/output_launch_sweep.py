"""The split's outputs' kernel (kda.triton.segments.add_entering_states) at several launches, then
the whole long call with the fastest beside the default, the launch before it, and fla (device runs).

``python benchmarks/output_launch_sweep.py OUT.json [CASE]``: CASE a ``kda bench --long`` case
number (default 3, 1x2097152 H8). First the kernel alone on that call's shapes (its segments as
the automatic split cuts them, random bf16 o_zero and o_P, float64 states): do_bench median of
every launch in LAUNCHES, the bytes it must move over that time, and whether its outputs equal
the first launch's (BEFORE) bit for bit. Then the whole call (``kda-cuda``) with
kda.triton.segments.LAUNCH set to BEFORE, to the default and to the fastest, in turn, twice, and
fla once, do_bench medians in this process. Written 2026-12-05 for issue 13: the kernel moved
12.9 GB in 6.08 ms on the H200 (run 150); run 151 (an H100) set Launch's defaults."""

import dataclasses
import datetime
import json
import sys

import torch
import triton.testing

from kda import segments
from kda.bench import contenders, make_inputs, measure_copy_tbps, versions
from kda.bench_long import LONG_CASES, timed_in_turn
from kda.triton import segments as out_kernel
from kda.triton.segments import Launch

# The launch before run 151 (one unrolled tile a program, a head's blocks in order); every other
# launch below changes some of its fields.
BEFORE = dict(tiles=1, stages=0, heads_first=False, v_parts=1, warps=8)
LAUNCHES = [
    Launch(**{**BEFORE, **changes})
    for changes in (
        {}, dict(tiles=2), dict(tiles=4), dict(tiles=8),
        dict(tiles=4, stages=2), dict(tiles=8, stages=2), dict(tiles=16, stages=2), dict(tiles=8, stages=3),
        dict(heads_first=True), dict(tiles=4, heads_first=True), dict(tiles=8, stages=2, heads_first=True),
        dict(v_parts=2), dict(v_parts=2, warps=4), dict(tiles=4, v_parts=2, warps=4),
        dict(tiles=8, stages=2, v_parts=2, warps=4), dict(tiles=4, warps=4), dict(tiles=8, stages=2, warps=4),
        # More tiles in flight for the H200, which needs more bytes in flight than the H100 that chose the
        # default (2026-12-06): three stages of whole-V tiles ran out of shared memory in run 151; with V
        # in two parts a stage's tiles are 48 KB, not 64 (not yet compiled on a GPU).
        dict(tiles=8, stages=3, v_parts=2, warps=4), dict(tiles=8, stages=3, v_parts=2, warps=8, heads_first=True),
        dict(tiles=16, stages=3, v_parts=2, warps=4, heads_first=True),
    )
]  # fmt: skip

out_path = sys.argv[1]
case = LONG_CASES[int(sys.argv[2]) if len(sys.argv) > 2 else 3]
(T,), HV, K = case["seq_lens"], case["H"], 128
span = segments.auto_span([T], HV, torch.cuda.get_device_properties(0).multi_processor_count)
offsets = torch.tensor([*range(0, T, span or T), T])


def sweep(report: dict) -> None:
    """The kernel alone at every launch of LAUNCHES, rows into ``report["kernel"]``."""
    gen = torch.Generator(device="cuda").manual_seed(151)
    o_zero = torch.randn(1, T, HV, K, device="cuda", generator=gen).bfloat16()
    o_P = torch.randn(1, T, HV, K, device="cuda", generator=gen).bfloat16()
    starts = torch.randn(offsets.numel() - 1, HV, K, K, device="cuda", generator=gen, dtype=torch.float64) / K
    moved = 3 * o_zero.numel() * 2  # o_zero and o_P read, o written
    want = out_kernel.add_entering_states(o_zero, o_P, starts, offsets, launch=Launch(**BEFORE))
    for launch in LAUNCHES:
        got = torch.full_like(o_zero, float("nan"))
        try:
            out_kernel.add_entering_states(o_zero, o_P, starts, offsets, out=got, launch=launch)
            same = bool(torch.equal(got, want))
            ms = triton.testing.do_bench(
                lambda launch=launch, got=got: out_kernel.add_entering_states(
                    o_zero, o_P, starts, offsets, out=got, launch=launch
                ),
                warmup=25, rep=200, return_mode="median",
            )  # fmt: skip
        except Exception as e:  # (a launch that does not compile or fit: its row says why)
            report["kernel"].append({"launch": dataclasses.asdict(launch), "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {launch}: {type(e).__name__}", flush=True)
            continue
        report["kernel"].append({"launch": dataclasses.asdict(launch), "ms": ms, "TBps": moved / ms / 1e9,
                                 "same_bits": same})  # fmt: skip
        print(f"  {launch}: {ms:.3f} ms, {moved / ms / 1e9:.2f} TB/s, same bits {same}", flush=True)


report = {"case": case["name"], "span": span, "gpu": torch.cuda.get_device_name(), "versions": versions(),
          "date": datetime.date.today().isoformat(),
          "copy_TBps": measure_copy_tbps(), "kernel": [], "call": []}  # fmt: skip
print(f"{case['name']}: segments of {span} tokens; copy {report['copy_TBps']:.2f} TB/s", flush=True)
sweep(report)
torch.cuda.empty_cache()

ran = [row for row in report["kernel"] if "ms" in row and row["same_bits"]]
best = Launch(**min(ran, key=lambda row: row["ms"])["launch"])
report["best"] = dataclasses.asdict(best)
report["best_setting"] = ",".join(f"{name}={int(value)}" for name, value in report["best"].items())
print(f"fastest with the first launch's bits: {best} ({out_kernel.SETTING}={report['best_setting']})", flush=True)

calls = contenders()
tensors, kw = make_inputs(case)


def use(launch):  # (LAUNCH: read at the call)
    return lambda: setattr(out_kernel, "LAUNCH", launch)


variants = [("before", use(Launch(**BEFORE))), ("default", use(Launch())), ("best", use(best))] * 2 + [("fla", None)]
report["call"] = timed_in_turn(calls, tensors, kw, variants, "  ")
with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
