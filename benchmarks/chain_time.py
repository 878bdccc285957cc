"""The segment split's boundary chain alone on the GPU: the Triton kernel (kda.triton.chain, what
the split runs on a GPU) and the float64 scan (kda.segments.chain_boundaries), beside a chain of
one product a segment in float64 (its form before 2026-12-03, 6b5b2d8) and in float32 (its form
in f1b78dd), on transitions of the shape of ``kda bench --long``'s H8 cases:
``python benchmarks/chain_time.py [SEGMENTS ...]``. Prints ms per call (do_bench median) and each
form's largest relative RMS against the float64 steps."""

import sys

import torch
import triton.testing

from kda import segments
from kda.reference import relative_rms
from kda.triton import chain

HV, K, V = 8, 128, 128


def stepwise(P, R, S0, counts, dtype):
    """One product a segment (the chain before the scan), sequence by sequence."""
    P, R, S = P.to(dtype), R.to(dtype), S0.to(dtype)
    starts, finals, j = [], [], 0
    for n, count in enumerate(counts):
        s = S[n]
        for _ in range(count):
            starts.append(s)
            s = torch.baddbmm(R[j], P[j], s)
            j += 1
        finals.append(s)
    return torch.stack(starts), torch.stack(finals)


for segs in [int(x) for x in sys.argv[1:]] or [32, 128]:
    gen = torch.Generator(device="cuda").manual_seed(segs)
    # contractive transitions, as a segment's decays make them
    P = torch.randn(segs, HV, K, K, generator=gen, device="cuda") * (0.9 / K**0.5)
    R = torch.randn(segs, HV, K, V, generator=gen, device="cuda")
    S0 = torch.randn(1, HV, K, V, generator=gen, device="cuda", dtype=torch.float64)
    counts = [segs]
    times = {
        "triton float32": triton.testing.do_bench(
            lambda: chain.chain_boundaries(P, R, S0, counts), return_mode="median"
        ),
        "scan float64": triton.testing.do_bench(
            lambda: segments.chain_boundaries(P, R, S0, counts), return_mode="median"
        ),
        "stepwise float64": triton.testing.do_bench(
            lambda: stepwise(P, R, S0, counts, torch.float64), return_mode="median"
        ),
        "stepwise float32": triton.testing.do_bench(
            lambda: stepwise(P, R, S0, counts, torch.float32), return_mode="median"
        ),
    }
    ref = stepwise(P, R, S0, counts, torch.float64)
    got = segments.chain_boundaries(P, R, S0, counts)
    tri = chain.chain_boundaries(P, R, S0, counts)
    f32 = stepwise(P, R, S0, counts, torch.float32)
    err = {
        "scan": max(relative_rms(a, b) for a, b in zip(got, ref)),
        "triton": max(relative_rms(a.double(), b) for a, b in zip(tri, ref)),
        "float32": max(relative_rms(a.double(), b) for a, b in zip(f32, ref)),
    }
    print(
        f"{segs} segments x {HV} heads: "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
        + f"; rel RMS against stepwise float64: {err}",
        flush=True,
    )
