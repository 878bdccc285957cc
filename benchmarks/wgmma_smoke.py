"""The wgmma K2's steps (abi.WGMMA_STEPS) on small calls, for compute-sanitizer: each candidate at
one and two CTAs an SM against the current step, bit for bit, on varlen with an empty, a one-token
and partial sequences and sequences of up to 13 chunks. Exits non-zero on a mismatch.
``python benchmarks/wgmma_smoke.py`` (gpu_session.sh: SANITIZE_SCRIPT=benchmarks/wgmma_smoke.py)."""

import sys

import torch

import kda
import kda.cuda
from kda import abi

sys.path.insert(0, "tests")
from helpers import make_case  # noqa: E402

case = make_case(seq_lens=[0, 1, 20, 100, 200, 33], H=2, K=128, V=128, dtype=torch.bfloat16, state_v_first=True,
                 device="cuda", seed=5)  # fmt: skip
bad = []
for ctas in abi.WGMMA_STAGES:
    kda.cuda.WARPS_OVERRIDE = f"wgmma{ctas}"
    results = {}
    for step in abi.WGMMA_STEPS:
        kda.cuda.WGMMA_STEP = step
        with kda.record_dispatch() as events:
            results[step] = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
        torch.cuda.synchronize()
        assert f"cuda:recurrence:wgmma{ctas}" in events, events
    for step, (o, ht) in results.items():
        same = torch.equal(o, results["current"][0]) and torch.equal(ht, results["current"][1])
        print(f"wgmma{ctas} {step}: {'same bits' if same else 'DIFFERENT'}")
        if not same:
            bad.append((ctas, step))
sys.exit(1 if bad else 0)
