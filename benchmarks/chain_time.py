"""The segment split's boundary chain alone on the GPU (kda.segments.chain_boundaries), one
float64 step a segment (chain_steps) against the default (one Triton kernel since 2026-12-05,
kda.triton.segments.chain_states) and blocks of segments (about the square root of the count,
the default before it, and other block lengths), on transitions of the shape of ``kda bench
--long``'s H8 cases: ``python benchmarks/chain_time.py [SEGMENTS ...]``. One JSON line a count:
ms a call (do_bench median) and each form's largest relative RMS against the steps."""

import json
import math
import sys

import torch
import triton.testing

from kda import segments
from kda.reference import relative_rms

HV, K, V = 8, 128, 128

for segs in [int(x) for x in sys.argv[1:]] or [8, 32, 128]:
    gen = torch.Generator(device="cuda").manual_seed(segs)
    # contractive transitions, as a segment's decays make them
    P = torch.randn(segs, HV, K, K, generator=gen, device="cuda") * (0.9 / K**0.5)
    R = torch.randn(segs, HV, K, V, generator=gen, device="cuda")
    S0 = torch.randn(1, HV, K, V, generator=gen, device="cuda", dtype=torch.float64)
    counts = [segs]
    forms = {
        "steps": lambda: segments.chain_steps(P, R, S0, counts),
        "default": lambda: segments.chain_boundaries(P, R, S0, counts),
    }
    for b in sorted({2, 4, math.isqrt(segs - 1) + 1, 16} - {1}):
        if b < segs:
            forms[f"blocks of {b}"] = lambda b=b: segments.chain_boundaries(P, R, S0, counts, block=b)
    ref = forms["steps"]()
    out = {"segments": segs, "heads": HV, "ms": {}, "rel_rms": {}}
    for name, form in forms.items():
        out["ms"][name] = triton.testing.do_bench(form, return_mode="median")
        out["rel_rms"][name] = max(relative_rms(a, b) for a, b in zip(form(), ref))
    print(json.dumps(out), flush=True)
