"""One decode configuration, called a few times, for ncu (benchmarks/gpu_session.sh step
``decodeprof``): ``python benchmarks/decode_profile.py BACKEND STATE MODE N [COLUMNS [WARPS]]`` with
BACKEND cuda or triton, STATE float32 or bfloat16, MODE plain or pool; the inputs of
``kda bench --decode`` (kda.bench_decode.decode_inputs)."""

import sys

import torch

import kda
from kda.api import checked_problem
from kda.bench_decode import decode_inputs, kw_indices
from kda.validation import check_pool

backend, state, mode, N = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], int(sys.argv[4])
columns = int(sys.argv[5]) if len(sys.argv) > 5 else None
warps = int(sys.argv[6]) if len(sys.argv) > 6 else None  # Triton's launch only
t, kw = decode_inputs(N, state_dtype=state)
if mode == "pool":
    kw_pool = {name: x for name, x in kw.items() if name != "initial_state"}
    p = check_pool(checked_problem(kda.fused_recurrent_kda, *t, **kw_pool), kw["initial_state"], kw_indices(N), None)
else:
    p = checked_problem(kda.fused_recurrent_kda, *t, **kw, output_final_state=True, final_state_dtype=state)
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
