"""What K1's three products in single tf32 would cost in accuracy, on the CPU:
``python benchmarks/k1_products.py [T]``.

K1 forms A = Diag(beta) K~ Kinv^T in 3xTF32 (float32-level), M = Q~ Kinv^T in one tf32 product
(stored in bf16), and w = inverse_beta K~ in 3xTF32 (stored in bf16) (prepare.cu, steps 2 and 4).
The candidate builds ``-DKDA_K1_A_TF32=1`` and ``-DKDA_K1_W_TF32=1`` take A and w to one tf32
product each, operands rounded to nearest. This runs the CUDA path's roundings as
benchmarks/pair_rounding.py models them (its ``stored`` and ``chunk_step``), with K1's float32
operands (K~, Kinv = k exp(-G), Q~) formed in float32 and each product in the form named, and
prints o and the final state against the float64 chunk form (relative RMS) for bf16 inputs, K =
V = 128, over input families where A's conditioning is worse than the bench's: keys of cosine
about 0.92, 0.99 and 0.9999 (a shared direction plus noise of 0.3, 0.1, 0.01), negative
eigenvalues (beta in (0, 2)), a long memory (the raw gate lowered by 6), and the precomputed gate
(with steep steps). ``truncated`` is the tensor core reading float32 bits as they are (its tf32
truncation), for comparison. The last column: inverse_beta (A 3xTF32 / tf32) against A in float32."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import pair_rounding as pr  # noqa: E402
from pair_rounding import tf32  # noqa: E402

from kda import reference  # noqa: E402
from kda.reference import relative_rms  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024


def truncated(x: torch.Tensor) -> torch.Tensor:
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def product(form: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if form == "3xtf32":  # the three largest of the split operands' products
        a_hi, b_hi = truncated(a), truncated(b)
        return a_hi @ b_hi + a_hi @ (b - b_hi) + (a - a_hi) @ b_hi
    if form == "tf32":
        return tf32(a) @ tf32(b)
    if form == "truncated":
        return truncated(a) @ truncated(b)
    if form == "float32":
        return a @ b
    raise ValueError(form)


def prepare(q, k, g, beta, scale, A_form, w_form) -> reference.ChunkOperands:
    """reference.prepare_chunk in float32 with K1's products (no row past the exp2 limit)."""
    C = q.shape[-2]
    e = reference.chunk_decays(g)
    k_decayed, q_decayed, k_inverse = k * e.from_start, scale * q * e.from_start, k / e.from_start
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    A = (product(A_form, k_decayed, k_inverse.mT) * beta.unsqueeze(-1)).masked_fill(~strict, 0.0)
    M = product("tf32", q_decayed, k_inverse.mT).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(0), 0.0)
    inverse_beta = reference.unit_lower_inverse(A) * beta.unsqueeze(-2)
    return reference.ChunkOperands(
        q_decayed=q_decayed, w=product(w_form, inverse_beta, k_decayed), inverse_beta=inverse_beta, M=M,
        k_restored=k * e.to_end, gamma=e.whole,
    )  # fmt: skip


def run(q, k, v, g, beta, scale, A_form, w_form):
    S = torch.zeros(pr.HV, pr.K, pr.V, dtype=torch.float32)
    o = torch.zeros_like(v)
    for c0 in range(0, q.shape[0], reference.CHUNK):
        rows = slice(c0, c0 + reference.CHUNK)
        ops = prepare(*(x[rows].transpose(0, 1) for x in (q, k, g, beta)), scale, A_form, w_form)
        O, S = pr.chunk_step(pr.stored(ops), v[rows].transpose(0, 1), S)
        o[rows] = O.transpose(0, 1)
    return o, S


def inverse_beta_error(q, k, v, g, beta, scale, A_form) -> float:
    """inverse_beta of every chunk with A in ``A_form`` against A in float32 (relative RMS): what
    tests/test_cuda.py's K1-against-Triton check (float32 products there) holds to 1e-4."""
    got, want = [], []
    for c0 in range(0, q.shape[0], reference.CHUNK):
        chunk = [x[c0 : c0 + reference.CHUNK].transpose(0, 1) for x in (q, k, g, beta)]
        got.append(prepare(*chunk, scale, A_form, "float32").inverse_beta)
        want.append(prepare(*chunk, scale, "float32", "float32").inverse_beta)
    return relative_rms(torch.cat(got).double(), torch.cat(want).double())


PROBLEMS = [  # (gate, key spread, negative eigenvalues, gate lowered by)
    ("lower_bound", None, False, 0.0),
    ("lower_bound", None, False, 6.0),
    ("lower_bound", 0.3, False, 6.0),
    ("lower_bound", 0.1, True, 6.0),
    ("lower_bound", 0.01, True, 6.0),
    ("precomputed", None, False, 0.0),
    ("precomputed", 0.1, False, 0.0),
    ("precomputed", 0.1, True, 0.0),
]
FORMS = [  # (name, A's product, w's product)
    ("today (A, w 3xTF32)", "3xtf32", "3xtf32"),
    ("A tf32", "tf32", "3xtf32"),
    ("w tf32", "3xtf32", "tf32"),
    ("A, w tf32", "tf32", "tf32"),
    ("A truncated", "truncated", "3xtf32"),
]

if __name__ == "__main__":
    print(f"o / final state against float64, relative RMS; T = {T}, HV = {pr.HV}, K = V = {pr.K}")
    print(
        "| gate | keys | beta | lowered | "
        + " | ".join(name for name, *_ in FORMS)
        + " | inverse_beta against A in float32: 3xTF32 / tf32 |"
    )
    print("|---|---|---|---:|" + "---|" * (len(FORMS) + 1))
    for gate, spread, negative, lowered in PROBLEMS:
        inputs, scale, o64, s64 = pr.problem(gate, spread, negative, lowered, seed=7, length=T)
        cells = []
        for _, A_form, w_form in FORMS:
            o, s = run(*inputs, scale, A_form, w_form)
            cells.append(f"{relative_rms(o, o64):.4e} / {relative_rms(s, s64):.4e}")
        keys = "random" if spread is None else f"shared + {spread} noise"
        inverse = " / ".join(f"{inverse_beta_error(*inputs, scale, form):.1e}" for form in ("3xtf32", "tf32"))
        print(f"| {gate} | {keys} | {'(0, 2)' if negative else '(0, 1)'} | {lowered} | " + " | ".join(cells) +
              f" | {inverse} |", flush=True)  # fmt: skip
