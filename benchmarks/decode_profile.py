"""One decode configuration, called a few times, for ncu (benchmarks/gpu_session.sh step
``decodeprof``): ``python benchmarks/decode_profile.py BACKEND STATE MODE N [COLUMNS [WARPS]]`` with
BACKEND cuda or triton, STATE float32 or bfloat16, MODE a ``bench_decode.decode_problem`` mode (plain, plain_f32,
pool, pool_random, ...); the inputs of ``kda bench --decode`` (kda.bench_decode.decode_inputs)."""

import sys

import torch

from kda.bench_decode import decode_problem

backend, state, mode, N = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], int(sys.argv[4])
columns = int(sys.argv[5]) if len(sys.argv) > 5 else None
warps = int(sys.argv[6]) if len(sys.argv) > 6 else None  # Triton's launch only
p = decode_problem(N, state, mode)
if backend == "cuda":
    from kda.cuda.decode import decode

    def run():
        return decode(p, columns)
else:
    from kda.triton.decode import decode

    def run():
        return decode(p, columns, warps)


for _ in range(4):
    run()
torch.cuda.synchronize()
print("ran", sys.argv[1:])
