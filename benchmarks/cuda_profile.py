"""Profiling targets for the CUDA path (device runs, notes in NOTES.md).

python benchmarks/cuda_profile.py host      # cProfile of eager tiny calls: where the host time goes
python benchmarks/cuda_profile.py kernels   # one call on 1x8192 H96 after a warm-up (ncu target)
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
else:
    case = bench.ANCHOR_CASES[int(sys.argv[2]) if len(sys.argv) > 2 else 0]
    tensors, kw = bench.make_inputs(case)
    kda.chunk_kda(*tensors, backend="cuda", **kw)
    torch.cuda.synchronize()
    kda.chunk_kda(*tensors, backend="cuda", **kw)
    torch.cuda.synchronize()
