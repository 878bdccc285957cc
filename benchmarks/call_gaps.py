"""Where an anchor call's do_bench time goes beyond its kernels (device runs).

python benchmarks/call_gaps.py [--cases 0,1,2,3] [--impls kda-cuda,fla] [--profile]

``triton.testing.do_bench`` zeroes a 256 MB buffer (the L2 flush) before each timed call, then
records the start event and calls. When the call's host code before its first launch takes
longer than that zeroing, the GPU idles inside the timed span. Per case and contender:

- ``bench``: the do_bench median, as ``kda bench`` takes it;
- ``gpu``: the same loop with ``torch.cuda._sleep`` queued before the flush, so the host has
  queued the whole call before the start event: the call's own GPU span (cold L2). (Run 81,
  2026-12-04, queued the sleep after the flush, which also left the GPU idle between the flush
  and the call: what the flush's dirty L2 lines cost the call then counted as host time.)
- ``host``: the host time of a call while the GPU is busy (no back-pressure);
- ``flush``: the GPU time of the flush alone.

``--profile`` adds a cProfile of kda-cuda's host path (200 calls, GPU kept busy) on the first case.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.testing

from kda import bench

SLEEP_CYCLES = 4_000_000  # about 2 ms at the H200's clocks: longer than any call's host path


def median_ms(fn, flush: torch.Tensor, reps: int, hide_host: bool) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if hide_host:  # before the flush, so that the GPU runs flush, start, call back to back as in do_bench
            torch.cuda._sleep(SLEEP_CYCLES)
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def host_us(fn, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def flush_ms(flush: torch.Tensor) -> float:
    return triton.testing.do_bench(flush.zero_, warmup=5, rep=20, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="0,1,2,3")
    parser.add_argument("--impls", default="kda-cuda,fla")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    calls = bench.pick_impls(bench.contenders(), args.impls)
    if calls is None:  # (pick_impls said which are missing)
        sys.exit(2)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # do_bench's size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"flush: {flush_ms(flush):.4f} ms")
    for i in (int(c) for c in args.cases.split(",")):
        case = bench.ANCHOR_CASES[i]
        tensors, kw = bench.make_inputs(case)
        for name, call in calls.items():
            fn = lambda call=call: call(tensors, kw)  # noqa: E731
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            do_bench = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            loop = median_ms(fn, flush, args.reps, hide_host=False)
            gpu = median_ms(fn, flush, args.reps, hide_host=True)
            print(
                f"{case['name']:>18} {name:>9}: do_bench {do_bench:.4f} ms, same loop {loop:.4f}, "
                f"host hidden {gpu:.4f} (exposed {1e3 * (loop - gpu):.1f} us), host {host_us(fn):.1f} us",
                flush=True,
            )
        if args.profile and "kda-cuda" in calls:
            fn = lambda: calls["kda-cuda"](tensors, kw)  # noqa: E731
            profiler = cProfile.Profile()
            for _ in range(200):
                torch.cuda.synchronize()  # an idle GPU: no launch waits on a full queue
                profiler.enable()
                fn()
                profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            args.profile = False


if __name__ == "__main__":
    main()
