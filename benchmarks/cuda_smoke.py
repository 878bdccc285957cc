"""A small CUDA-path call for compute-sanitizer (memcheck, racecheck): varlen with an empty,
a one-token and a tail-chunk sequence, both state layouts, float32 and bfloat16 states. Exits
non-zero on a wrong answer."""

import sys

import torch

import kda
from kda.reference import relative_rms

sys.path.insert(0, "tests")
from helpers import fp64_reference, make_case  # noqa: E402

worst = 0.0
for layout, state_dtype in ((False, torch.float32), (True, torch.float32), (True, torch.bfloat16)):
    case = make_case(seq_lens=[0, 1, 37, 16], H=2, K=128, V=128, dtype=torch.bfloat16, state_v_first=layout,
                     device="cuda", seed=3)  # fmt: skip
    case.initial_state = case.initial_state.to(state_dtype)
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs(final_state_dtype=state_dtype))
    torch.cuda.synchronize()
    assert "cuda:recurrence" in events, events
    o_ref, ht_ref = fp64_reference(case)
    worst = max(worst, relative_rms(o.cpu(), o_ref), relative_rms(ht.cpu(), ht_ref))
print(f"cuda smoke: worst relative RMS {worst:.2e}")
sys.exit(0 if worst <= 5e-3 else 1)
