"""What K1's w in one tf32 product (in place of 3xTF32) would cost in accuracy, on the CPU:
``python benchmarks/w_rounding.py [T]``.

K1 forms ``w = inverse_beta K~`` (16 x 128 over 16 tokens) in 3xTF32, float32-level, and stores
it in bf16 (prepare.cu, step 4). One tf32 product would round both operands to 10 mantissa bits
first (a relative 2^-11 each, against the store's 2^-9), and issue a third of the MMAs without
the operands' splits. This runs the CUDA path's roundings as benchmarks/pair_rounding.py models
them (its ``stored`` and ``chunk_step``), with w formed both ways, and prints o and the final
state against the float64 chunk form (relative RMS): bf16 inputs, K = V = 128, the lower-bound
gate as bench cases draw it and the same lowered by 6 (a long memory)."""

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.argv = sys.argv[:2]  # (pair_rounding reads T from argv; its own loop runs at import)
import pair_rounding as pr  # noqa: E402

from kda import reference  # noqa: E402
from kda.reference import relative_rms  # noqa: E402


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 to the nearest tf32 (10 mantissa bits; ties away from zero), as prepare.cu's
    round_tf32 and the tensor core's truncation together give."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def run(q, k, v, g, beta, scale, one_tf32: bool):
    S = torch.zeros(pr.HV, pr.K, pr.V, dtype=torch.float32)
    o = torch.zeros_like(v)
    for rows, (ops,) in reference.step_operands(q, k, g, beta, scale, 1):
        if one_tf32:
            e = reference.chunk_decays(g[rows].transpose(0, 1))
            k_decayed = k[rows].transpose(0, 1) * e.from_start
            ops = dataclasses.replace(ops, w=tf32(ops.inverse_beta) @ tf32(k_decayed))
        O, S = pr.chunk_step(pr.stored(ops), v[rows].transpose(0, 1), S)
        o[rows] = O.transpose(0, 1)
    return o, S


print("\nw in one tf32 product against 3xTF32 (the CUDA path's other roundings as above):")
for lowered in (0.0, 6.0):
    case = pr.make_case(B=1, T=pr.T, H=pr.HV, HV=pr.HV, K=pr.K, V=pr.V, dtype=torch.bfloat16, gate="lower_bound",
                        seed=5)  # fmt: skip
    case.g = case.g - lowered
    c64 = case.to(torch.float64, "cpu")
    q, k, g, beta = reference.activate_inputs(
        c64.q, c64.k, c64.g, c64.beta, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True,
        A_log=c64.A_log, dt_bias=c64.dt_bias.view(pr.HV, -1), lower_bound=-5.0,
    )  # fmt: skip
    scale = pr.K**-0.5
    o64, s64 = reference.chunk16_kda(q, k, c64.v, g, beta, scale=scale, output_final_state=True)
    inputs32 = [x[0].float() for x in (q, k, c64.v, g, beta)]
    print(f"T = {pr.T}, gate lowered by {lowered}:")
    for name, one in (("3xTF32", False), ("one tf32", True)):
        o, s = run(*inputs32, scale, one)
        print(f"  {name:9s} o {relative_rms(o, o64[0]):.4e}  state {relative_rms(s, s64[0]):.4e}")
