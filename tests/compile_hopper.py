"""Compile the Triton kernels for sm_90 without a GPU (run by test_kernels_compile_for_hopper).

``python tests/compile_hopper.py --ptxas`` also prints what Triton's own ptxas makes of each
variant (registers, stack, spill bytes; ``--ptxas=NAME``: kernel NAME's only): a register
allocation gone wrong shows without a GPU.
Arguments are specialised as a launch with 16-byte-aligned tensors and sizes that are multiples
of 16 would specialise them."""

import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

from kda.triton.chunk_grad import (
    INPUT_GRAD_SLICE,
    chunk_du_grads_kernel,
    chunk_input_grads_kernel,
    chunk_state_grads_kernel,
)
from kda.triton.decode import decode_kernel
from kda.triton.prepare import prepare_chunks_kernel
from kda.triton.recurrence import recurrence_v_split_kernel
from kda.triton.segments import CHAIN_BK, CHAIN_BV, CHAIN_WARPS, chain_states_kernel
from kda.triton.state_grad import state_grad_chain_kernel
from kda.triton.tables import build_tables_kernel

FP32 = ("A_log", "dt_bias", "gamma", "inverse_beta", "M", "h0", "ht", "checkpoints", "dht", "dh0", "dA_log_part",
        "ddt_bias_part", "d_operands", "d_squares", "d_gamma_in", "d_gamma_out", "d_u")  # fmt: skip
POINTERS = {
    **{n: "*fp32" for n in FP32},
    **{
        n: "*i64"
        for n in ("seq_offsets", "chunk_offsets", "chunk_seq", "checkpoint_offsets", "cu_seqlens", "seq_order")
    },
    **{n: "*i32" for n in ("indices", "accepted")},
    "far": "*i8",
}
# --ptxas: every variant's figures; --ptxas=NAME: those of the kernel NAME only
PTXAS_STATS = next((a.partition("=")[2] or "*" for a in sys.argv if a.split("=")[0] == "--ptxas"), None)


def build(kernel, scalars: dict, consts: dict, num_warps: int = 4, tensor_cores: bool = True, stages=None) -> None:
    # The pipeline depth of the kernel's first autotune config (what a launch compiles), else
    # 2: at 2 stages the input-gradient kernel takes 255 registers against 252 at its launched
    # 1 (ptxas, 2026-12-02), so figures at another depth describe another kernel.
    configs = getattr(kernel, "configs", None)
    num_stages = stages or (configs[0].num_stages if configs else 2)  # (stages: the launch's own)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    sig = {n: POINTERS.get(n, "*bf16") for n in kernel.arg_names}
    sig.update(scalars)
    sig.update({c: "constexpr" for c in consts})
    # As a launch specialises them for aligned tensors and shapes that are multiples of 16 (the
    # benchmarks'): without it loads are not vectorised, and ptxas's figures are a different
    # kernel's (the decode step: 255 registers unspecialised, 211 specialised).
    multiple = [i for i, n in enumerate(kernel.arg_names) if sig[n][0] == "*" or sig[n] == "i32"]
    aligned = {(i,): [["tt.divisibility", 16]] for i in multiple}
    compiled = compile(
        ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=aligned),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    assert not tensor_cores or "mma" in compiled.asm["ptx"], "no tensor-core instruction in the PTX"
    print("compiled", kernel.__name__, f"{num_warps} warps, {num_stages} stages", consts)
    if PTXAS_STATS in ("*", kernel.__name__):
        print("   ", ptxas_stats(compiled.asm["ptx"]))


def ptxas_stats(ptx: str) -> str:
    """Registers, stack and spill bytes that Triton's own ptxas reports for ``ptx`` (sm_90a)."""
    try:
        ptxas = get_ptxas(90).path
    except TypeError:  # older Triton takes no architecture
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(src), "-o", str(src.with_suffix(".o"))],
                             capture_output=True, text=True, check=True)  # fmt: skip
    regs = re.search(r"Used (\d+) registers", res.stderr).group(1)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    return f"registers {regs}, stack {frame.group(1)} B, spill stores {frame.group(2)} B, loads {frame.group(3)} B"


# every gate with and without l2norm in the first launch; the second launch (prepare.FAR_LAUNCHES)
# of the gates that have one
for gate, l2, pairwise in [*((g, l2, False) for g, l2 in itertools.product((0, 1, 2), (False, True))),
                           (0, True, True), (2, True, True)]:  # fmt: skip
    build(
        prepare_chunks_kernel,
        {"scale": "fp32", "lower_bound": "fp32", "beta_scale": "fp32", "H": "i32", "HV": "i32", "K": "i32"},
        dict(BK=128, GATE=gate, HAS_A_LOG=True, HAS_DT_BIAS=True, L2NORM=l2,
             BETA_SIGMOID=True, SAFE=gate == 1, DOT_PRECISION="tf32", PAIRWISE=pairwise),
    )  # fmt: skip
for mixed, (BV, num_warps) in itertools.product((False, True), ((16, 1), (32, 2), (64, 4))):
    build(
        recurrence_v_split_kernel,
        {"PARALLEL_BUCKET": "i32", "HV": "i32", "K": "i32", "V": "i32"},
        dict(BK=128, BV=BV, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=mixed, CHECKPOINT=4 if mixed else 0,
             MIXED=mixed, DOT_PRECISION="tf32", INTERPRET=False),
        num_warps,
    )  # fmt: skip
for mixed, (BV, num_warps) in itertools.product((False, True), ((32, 2), (64, 4))):
    build(
        state_grad_chain_kernel,
        {"PARALLEL_BUCKET": "i32", "HV": "i32", "K": "i32", "V": "i32"},
        dict(BK=128, BV=BV, HAS_DHT=True, STORE_DH0=True, STATE_V_FIRST=mixed,
             MIXED=mixed, DOT_PRECISION="tf32", INTERPRET=False),
        num_warps,
    )  # fmt: skip
# K1's workspace (K1_LAYOUT, the CUDA reverse chain's backward): its 16 x 16 operands are bf16 views
K1_SQUARES = {"inverse_beta": "*bf16", "inverse_beta_lo": "*bf16", "M": "*bf16"}
for (BV, num_warps), k1 in itertools.product(((32, 8), (64, 4)), (False, True)):
    build(
        chunk_state_grads_kernel,
        {"HV": "i32", "K": "i32", "V": "i32", **(K1_SQUARES if k1 else {})},
        dict(BK=128, BV=BV, MIXED=True, DOT_PRECISION="tf32", INTERPRET=False, CHECKPOINT=4, K1_LAYOUT=k1),
        num_warps,
    )  # fmt: skip
# float32-accurate products on the tensor cores (chunk_grad.DU_PRECISION)
for k1 in (False, True):
    squares = {n: K1_SQUARES[n] for n in ("inverse_beta", "inverse_beta_lo")} if k1 else {}
    build(chunk_du_grads_kernel, {"HV": "i32", "V": "i32", **squares}, dict(BV=64, K1_LAYOUT=k1), 4)
# the safe lower-bound gate in one launch; the others in two (prepare.FAR_LAUNCHES)
for gate, pairwise in ((0, False), (0, True), (1, False), (2, False), (2, True)):
    build(
        chunk_input_grads_kernel,
        {"scale": "fp32", "lower_bound": "fp32", "beta_scale": "fp32", "H": "i32", "HV": "i32", "K": "i32"},
        dict(BK=128, SLICE=INPUT_GRAD_SLICE, GATE=gate, HAS_A_LOG=True, HAS_DT_BIAS=True, L2NORM=True,
             BETA_SIGMOID=True, SAFE=gate == 1, DOT_PRECISION="tf32", PAIRWISE=pairwise),
        4,
    )  # fmt: skip
# the chunk tables (integer work: no tensor cores)
for varlen, rank in ((True, True), (True, False), (False, False)):
    build(
        build_tables_kernel,
        {"N": "i32", "T": "i32", "T_EACH": "i32", "H": "i32", "SLOTS": "i32"},
        dict(VARLEN=varlen, RANK=rank, CHECKPOINT=4, BLOCK=64),
        tensor_cores=False,
    )  # fmt: skip
# decode: plain (batched), a 1-D pool and a 2-D pool (varlen), one warp and four, with and without cache hints
for indices, (BV, num_warps), stream in ((0, (16, 1), False), (1, (16, 1), False), (2, (32, 4), True)):
    build(
        decode_kernel,
        {"scale": "fp32", "lower_bound": "fp32", "beta_scale": "fp32",
         **{n: "i32" for n in ("P", "T", "H", "HV", "K", "V", "S_COLS")}},
        dict(BK=128, BV=BV, GATE=1, HAS_A_LOG=True, HAS_DT_BIAS=True, L2NORM=True, BETA_SIGMOID=True,
             STATE_V_FIRST=indices == 2, VARLEN=indices == 2, HAS_H0=True, STORE_HT=True, INDICES=indices,
             HAS_ACCEPTED=indices == 2, STREAM=stream, IN_PLACE=indices != 0),
        num_warps, tensor_cores=False,
    )  # fmt: skip
# the segment split's boundary chain (float64 products on the tensor cores), float32 transitions,
# its strides as the 2M H8 bench call's launch specialises them (i32; P contiguous, R a V-first
# state's [V, K] view, S0 zeros: the unit strides constant)
STRIDES = ("p_s", "p_h", "p_i", "r_s", "r_h", "r_v", "s0_n", "s0_h", "s0_k")
build(
    chain_states_kernel,
    {"P": "*fp32", "R": "*fp32", **{n: "*fp64" for n in ("S0", "starts", "finals")}, "first": "*i64",
     "counts": "*i64", **{n: "i32" for n in STRIDES}},
    dict(HV=8, K=128, V=128, KP=128, BK=CHAIN_BK, BV=CHAIN_BV, p_j=1, r_k=1, s0_v=1),
    CHAIN_WARPS,
    stages=1,
)  # fmt: skip
