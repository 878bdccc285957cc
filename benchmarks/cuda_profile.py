"""Profiling targets for the CUDA path (device runs, notes in NOTES.md).

python benchmarks/cuda_profile.py host      # cProfile of eager tiny calls: where the host time goes
python benchmarks/cuda_profile.py kernels   # one call on 1x8192 H96 after a warm-up (ncu target)
python benchmarks/cuda_profile.py prefill   # cProfile of the serving prefill (kda bench --decode's), auto backend
"""

import cProfile
import pstats
import sys
import time

import torch

import kda
from kda import bench

mode = sys.argv[1] if len(sys.argv) > 1 else "host"
if mode == "host":
    tensors, kw = bench.make_inputs({"seq_lens": [64], "H": 1})
    for backend in ("cuda", "triton"):
        for _ in range(5):
            kda.chunk_kda(*tensors, backend=backend, **kw)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(300):
            kda.chunk_kda(*tensors, backend=backend, **kw)
        print(f"{backend}: {(time.perf_counter() - start) / 300 * 1e6:.1f} us per eager call", flush=True)
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        kda.chunk_kda(*tensors, backend="cuda", **kw)
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
elif mode == "prefill":  # host time 0.184 ms a call in run 18, 0.357 in run 28: where it goes
    from kda.bench_decode import prefill_inputs

    layouts, t, kw = prefill_inputs()

    def step(i):
        cu, host = layouts[i % len(layouts)]
        n = int(host[-1])
        with torch.inference_mode():
            pieces = (x[:, :n] for x in t)
            return kda.chunk_kda(*pieces, **kw, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=host)

    for i in range(2 * len(layouts)):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(len(layouts)):
        step(i)
    print(f"prefill: {(time.perf_counter() - start) / len(layouts) * 1e3:.3f} ms host time a call", flush=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(160):
        step(i)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
else:
    case = bench.ANCHOR_CASES[int(sys.argv[2]) if len(sys.argv) > 2 else 0]
    tensors, kw = bench.make_inputs(case)
    kda.chunk_kda(*tensors, backend="cuda", **kw)
    torch.cuda.synchronize()
    kda.chunk_kda(*tensors, backend="cuda", **kw)
    torch.cuda.synchronize()
