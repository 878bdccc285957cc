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

sys.path.insert(0, os.path.dirname(__file__))  # (pair_rounding reads T from the same argv)
import pair_rounding as pr  # noqa: E402

from kda import reference  # noqa: E402
from kda.reference import relative_rms  # noqa: E402


def run(q, k, v, g, beta, scale, one_tf32: bool):
    S = torch.zeros(pr.HV, pr.K, pr.V, dtype=torch.float32)
    o = torch.zeros_like(v)
    for rows, (ops,) in reference.step_operands(q, k, g, beta, scale, 1):
        if one_tf32:
            e = reference.chunk_decays(g[rows].transpose(0, 1))
            k_decayed = k[rows].transpose(0, 1) * e.from_start
            ops = dataclasses.replace(ops, w=pr.tf32(ops.inverse_beta) @ pr.tf32(k_decayed))
        O, S = pr.chunk_step(pr.stored(ops), v[rows].transpose(0, 1), S)
        o[rows] = O.transpose(0, 1)
    return o, S


if __name__ == "__main__":
    print("w in one tf32 product against 3xTF32 (the CUDA path's other roundings as pair_rounding.py's):")
    for lowered, inputs32, scale, o64, s64 in pr.problems():
        print(f"T = {pr.T}, gate lowered by {lowered}:")
        for name, one in (("3xTF32", False), ("one tf32", True)):
            o, s = run(*inputs32, scale, one)
            print(f"  {name:9s} o {relative_rms(o, o64):.4e}  state {relative_rms(s, s64):.4e}")
