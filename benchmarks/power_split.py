"""Which of kda-cuda's kernels runs into the H200's power cap, and what a call costs in energy
(device runs): ``python benchmarks/power_split.py [--cases 0,2,3,4] [--seconds 3] [--rest 6]``.

Run 100 (benchmarks/NOTES.md, 2026-12-04) found kda-cuda's 1x8192 H96 call at 0.910 ms in a
fresh process's first timing (1980 MHz) and 0.975-0.98 ms in every later one, the board at about
690 W under the driver's software power cap, while fla's call drew about 300 W at 1980 MHz. This
says which part draws the power. Per anchor case (kda.bench.ANCHOR_CASES) and part, each run
back to back for ``--seconds`` after ``--rest`` seconds idle (so that every part starts uncapped):

- ``k1``: K1 (prepare) alone, every launch into the same workspace;
- ``k2``: K2 (recurrence) alone on that workspace;
- ``call``: the whole ``chunk_kda(..., backend="cuda")`` call;
- ``fla``: fla's ``chunk_kda`` (FLA_FLASH_KDA=0), where fla is installed.

The launches go in batches of about 25 ms of GPU work, an event after each, so the GPU never
waits for the host; nvidia-smi (kda.clocks.ClockSampler) samples the SM clock, power and throttle
reasons every 100 ms beside them. Per part: ms a call in the first batch and in the last second,
the median SM clock, mean and highest power and the share of samples under the power cap over
the last second, and the energy a call (mean power x ms). One JSON line per part, and a table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import triton.testing

import kda
from kda import api, bench
from kda.clocks import SW_POWER_CAP, ClockSampler
from kda.cuda import forward

BATCH_MS = 25.0  # GPU work between two events
TAIL_S = 1.0  # the steady state: the part's last second


def parts(case: dict) -> dict:
    """part name -> a callable launching it once, on the case's inputs."""
    tensors, kw = bench.make_inputs(case)
    p = api.checked_problem(kda.chunk_kda, *tensors, **kw)
    kernels, device_index, stream, capturing = forward._launch_context(p)
    o, ht = forward._outputs(p)
    tables, workspace = forward._tables_and_workspace(p, kernels, device_index, stream, capturing, keep=False)
    launch = (p, o, ht, workspace, tables, kernels, device_index, stream)
    out = {
        "k1": lambda: forward._launch(*launch, True, run_recurrence=False),
        "k2": lambda: forward._launch(*launch, False),
        "call": lambda: kda.chunk_kda(*tensors, backend="cuda", **kw),
    }
    contenders = bench.contenders()
    if "fla" in contenders:
        out["fla"] = lambda: contenders["fla"](tensors, kw)
    return out


def run_for(fn, seconds: float, ms_each: float) -> list[tuple[float, float, int]]:
    """``fn`` back to back for about ``seconds`` of GPU time: ``(host time the batch's event
    completed, GPU ms a call in it, calls)`` per batch, bounded to two batches queued."""
    per_batch = max(1, round(BATCH_MS / ms_each))
    batches = max(2, round(1000 * seconds / (per_batch * ms_each)))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(batches + 1)]
    events[0].record()
    out = []
    for b in range(batches):
        for _ in range(per_batch):
            fn()
        events[b + 1].record()
        if b >= 1:  # wait for the batch before this one: the GPU keeps one batch queued
            events[b].synchronize()
            out.append((time.time(), events[b - 1].elapsed_time(events[b]) / per_batch, per_batch))
    events[batches].synchronize()
    out.append((time.time(), events[batches - 1].elapsed_time(events[batches]) / per_batch, per_batch))
    return out


def summarise(series, sampler: ClockSampler) -> dict:
    t_end = series[-1][0]
    tail = [ms for at, ms, _ in series if at >= t_end - TAIL_S]
    (window,) = sampler.windows([(t_end - TAIL_S, t_end)])
    samples = [s for at, s in list(sampler.samples) if t_end - TAIL_S <= at <= t_end + 0.1]
    mean_w = statistics.fmean(s[1] for s in samples) if samples else None
    ms = statistics.median(tail)
    return {
        "first_ms": round(series[0][1], 4),
        "ms": round(ms, 4),
        "sm_mhz": window and window["sm_mhz"],
        "power_w_mean": mean_w and round(mean_w, 1),
        "power_w_max": window and window["power_w_max"],
        "power_capped": window and round(window["power_capped"], 2),
        "mj_per_call": mean_w and round(mean_w * ms, 3),  # W x ms = mJ
        "calls": sum(n for *_, n in series),
    }


def power_limit() -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=power.limit,power.max_limit", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="0,2,3,4")
    parser.add_argument("--parts", default="k1,k2,call,fla")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rest", type=float, default=6.0)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "power-split.jsonl"))
    args = parser.parse_args()
    rows = []
    with ClockSampler(torch.cuda.current_device()) as sampler, open(args.out, "w") as f:
        head = bench.start_jsonl(f, power_limit=power_limit(), seconds=args.seconds, rest=args.rest)
        for i in (int(c) for c in args.cases.split(",")):
            case = bench.ANCHOR_CASES[i]
            calls = parts(case)
            for name in args.parts.split(","):
                if name not in calls:
                    continue
                fn = calls[name]
                fn()  # compiles, tunes (fla), loads
                torch.cuda.synchronize()
                ms_each = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
                time.sleep(args.rest)
                row = {"case": case["name"], "part": name} | summarise(run_for(fn, args.seconds, ms_each), sampler)
                rows.append(row)
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")
    print(f"\npower limit: {head['power_limit']}; cap bit {SW_POWER_CAP:#x}")
    print("| case | part | first ms | steady ms | SM MHz | W mean | W max | capped | mJ a call |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['part']} | {r['first_ms']} | {r['ms']} | {r['sm_mhz']} | {r['power_w_mean']} | "
              f"{r['power_w_max']} | {r['power_capped']} | {r['mj_per_call']} |")  # fmt: skip


if __name__ == "__main__":
    main()
