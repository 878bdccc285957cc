"""What two chunks a sequential step (docs/algorithm.md section 2b) would cost in accuracy on
the CUDA path's roundings, on the CPU: ``python benchmarks/pair_rounding.py [T]``.

Both forms are simulated as K1 and K2 round (2026-12-04, 87ccfc3): K1's operands computed in
float32 and stored in bf16 (inverse_beta as a bf16 pair, hi + lo; gamma in float32), the state
in float32, rounded to bf16 as the left operand of its products with w and q_decayed, U rounded
to bf16 for its products with k_restored and M, float32 sums. The pair's new operands (w_b and
q_decayed_b rescaled by gamma_a, k_restored_a by gamma_b, the coupling D, the cross block of M)
are formed from K1's float32 values and rounded once, as a pair K1 would store them; D is
tried in bf16 and as a bf16 pair. Prints o and the final state against the float64 chunk form
(relative RMS), bf16 inputs, K = V = 128, the lower-bound gate as bench cases draw it and the
same lowered by 6 (a long memory)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from helpers import make_case  # noqa: E402
from kda import reference  # noqa: E402
from kda.reference import relative_rms  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
HV, K, V = 2, 128, 128


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 to the nearest tf32 (10 mantissa bits; ties away from zero), as prepare.cu's
    round_tf32 and the tensor core's truncation together give."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def pair_of_bf16(x: torch.Tensor) -> torch.Tensor:
    hi = bf16(x)
    return hi + bf16(x - hi)


def stored(ops: reference.ChunkOperands) -> reference.ChunkOperands:
    """K1's workspace as the recurrence reads it: bf16-rounded values (inverse_beta a bf16 pair)."""
    return reference.ChunkOperands(
        q_decayed=bf16(ops.q_decayed),
        w=bf16(ops.w),
        inverse_beta=pair_of_bf16(ops.inverse_beta),
        M=bf16(ops.M),
        k_restored=bf16(ops.k_restored),
        gamma=ops.gamma,
    )


def chunk_step(ops, v, S):
    """K2's chunk step on stored operands: S in float32, bf16 where it is an MMA operand."""
    U = ops.inverse_beta @ v - ops.w @ bf16(S)
    Ub = bf16(U)
    O = ops.q_decayed @ bf16(S) + ops.M @ Ub
    return O, ops.gamma.unsqueeze(-1) * S + ops.k_restored.transpose(-1, -2) @ Ub


def pair_step(ops: reference.PairOperands, v, S, Ca):
    X = ops.inverse_beta @ v - ops.w @ bf16(S)
    Ua = bf16(X[..., :Ca, :])
    U = bf16(torch.cat([Ua, X[..., Ca:, :] - ops.coupling @ Ua], -2))
    O = ops.q_decayed @ bf16(S) + ops.M @ U
    return O, ops.gamma.unsqueeze(-1) * S + ops.k_restored.transpose(-1, -2) @ U


def run(q, k, v, g, beta, scale, pairs: bool, coupling_round=bf16):
    """One sequence ``[T, HV, ...]`` from a zero state, float32 arithmetic."""
    S = torch.zeros(HV, K, V, dtype=torch.float32)
    o = torch.zeros_like(v)
    for rows, exact in reference.step_operands(q, k, g, beta, scale, 2 if pairs else 1):
        v_c = v[rows].transpose(0, 1)
        if len(exact) == 2:
            p = reference.pair_operands(*exact)
            ops = reference.PairOperands(
                q_decayed=bf16(p.q_decayed), w=bf16(p.w), inverse_beta=pair_of_bf16(p.inverse_beta),
                coupling=coupling_round(p.coupling), M=bf16(p.M), k_restored=bf16(p.k_restored), gamma=p.gamma,
            )  # fmt: skip
            O, S = pair_step(ops, v_c, S, exact[0].w.shape[-2])
        else:
            O, S = chunk_step(stored(exact[0]), v_c, S)
        o[rows] = O.transpose(0, 1)
    return o, S


def problem(gate: str = "lower_bound", spread: float | None = None, negative: bool = False, lowered: float = 0.0,
            seed: int = 5, length: int = T):  # fmt: skip
    """``(inputs, scale, o64, s64)``: the activated float32 inputs ``(q, k, v, g, beta)`` of one
    sequence ``[length, HV, ...]`` of bf16 draws and the float64 chunk form's o and final state on
    them. ``gate``: the lower-bound gate in the kernel, or "precomputed" (with steep steps);
    ``spread``: every key a shared direction (per head) plus noise of this size; ``negative``:
    beta in (0, 2); ``lowered``: the raw gate lowered by this much (a long memory)."""
    case = make_case(B=1, T=length, H=HV, HV=HV, K=K, V=V, dtype=torch.bfloat16, gate=gate, seed=seed,
                     steep_steps=8 if gate == "precomputed" else 0)  # fmt: skip
    if spread is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        base = torch.randn(1, 1, HV, K, generator=gen)
        case.k = (base + spread * torch.randn(case.k.shape, generator=gen)).to(torch.bfloat16)
    case.g = case.g - lowered
    c64 = case.to(torch.float64, "cpu")
    in_kernel = gate != "precomputed"
    q, k, g, beta = reference.activate_inputs(
        c64.q, c64.k, c64.g, c64.beta, use_qk_l2norm=True, use_gate=in_kernel, use_beta_sigmoid=True,
        allow_neg_eigval=negative, A_log=c64.A_log, lower_bound=-5.0 if in_kernel else None,
        dt_bias=None if c64.dt_bias is None else c64.dt_bias.view(HV, -1),
    )  # fmt: skip
    scale = K**-0.5
    o64, s64 = reference.chunk16_kda(q, k, c64.v, g, beta, scale=scale, output_final_state=True)
    return [x[0].float() for x in (q, k, c64.v, g, beta)], scale, o64[0], s64[0]


def problems():
    """``(lowered, inputs, scale, o64, s64)`` for the bench gate and the same lowered by 6
    (:func:`problem`'s)."""
    for lowered in (0.0, 6.0):
        yield lowered, *problem(lowered=lowered)


if __name__ == "__main__":
    for lowered, inputs32, scale, o64, s64 in problems():
        print(f"T = {T}, gate lowered by {lowered}:")
        forms = (("chunk", False, bf16), ("pair, D bf16", True, bf16), ("pair, D hi+lo", True, pair_of_bf16))
        for name, pairs, rounding in forms:
            o, s = run(*inputs32, scale, pairs, rounding)
            print(f"  {name:14s} o {relative_rms(o, o64):.3e}  state {relative_rms(s, s64):.3e}")
