"""Where one long call's time goes on the CUDA path (device runs): every kernel's GPU time, the
call's wall time against their sum (the rest is the GPU waiting for the host, or kernels of
other streams overlapping), and whether the caching allocator ran short of memory.

``python benchmarks/long_profile.py [CASE [SEGMENT_TOKENS [IMPL]]]``: CASE a ``kda bench --long``
case number (default 3, 1x2097152 H8); SEGMENT_TOKENS sets ``KDA_SEGMENT_TOKENS`` (0: uncut; -:
as dispatched); IMPL a ``kda bench`` contender (default kda-cuda; fla for its kernels beside).
Written for run 147's 2M H8 call, which took 52.7 ms on an H100 against 32.0 on
the H200 (benchmarks/NOTES.md, 2026-12-05). Prints a table and one JSON line."""

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kda.bench import contenders, make_inputs, versions
from kda.bench_long import LONG_CASES
from kda.segments import SETTING

if len(sys.argv) > 2 and sys.argv[2] != "-":  # (read by every call)
    os.environ[SETTING] = sys.argv[2]

case = LONG_CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 3]
impl = sys.argv[3] if len(sys.argv) > 3 else "kda-cuda"
call = contenders()[impl]
tensors, kw = make_inputs(case)
row = {"case": case["name"], "impl": impl, "segment_tokens": os.environ.get(SETTING),
       "gpu": torch.cuda.get_device_name(), "versions": versions()}  # fmt: skip

with torch.inference_mode():
    call(tensors, kw)  # compile, tables, the allocator's first blocks
    torch.cuda.synchronize()
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(tensors, kw)
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
    row["wall_ms"] = walls
    # (retries: a cudaMalloc that failed, the cache freed and tried again, each a device sync)
    row["alloc_retries_in_3_calls"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    row["peak_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
    row["reserved_GB"] = torch.cuda.memory_reserved() / 1e9
    calls = 2
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call(tensors, kw)
        torch.cuda.synchronize()

kernels = {}
for event in prof.key_averages():
    # kernels, copies and fills: the device's own events (a CPU op's device time repeats its kernels')
    device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
    if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
        kernels[event.key] = (device_us / calls / 1e3, event.count // calls)
row["kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1][0]))
row["kernels_sum_ms"] = sum(ms for ms, _ in kernels.values())
print(f"{row['gpu']}: {case['name']}, {impl}, {SETTING}={row['segment_tokens']}")
print(f"wall ms {', '.join(f'{w:.3f}' for w in walls)}; kernels summed {row['kernels_sum_ms']:.3f} ms a call;"
      f" allocator retries in 3 calls {row['alloc_retries_in_3_calls']}; peak {row['peak_allocated_GB']:.1f} GB,"
      f" reserved {row['reserved_GB']:.1f} GB")  # fmt: skip
for name, (ms, count) in list(row["kernels_ms"].items())[:25]:
    print(f"{ms:9.3f} ms  x{count:<4d} {name[:110]}")
print(json.dumps(row))
