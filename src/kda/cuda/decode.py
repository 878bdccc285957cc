"""The CUDA decode step (decode.cu): fill the DecodeParams block from a checked Problem and
launch one CTA per (sequence, value head, slice of V columns).

It takes what the CUDA chunk path takes (bf16 q, k, v; K = V = 128; the lower-bound gate or a
precomputed g, read in bf16 or fp32) plus grouped value heads and state pools with 1-D or 2-D
slot indices; the state in float32 or bfloat16, written back in its own dtype or, a bfloat16
state of a plain call, in float32 (abi.DECODE_STATE_PAIRS; auto's thresholds for that form are
the bfloat16 ones: on an H100, 2026-12-07, run 207, it took 0.0405 ms at N=32, 1024 pairs,
where Triton's took 0.0450 in the same process). The kernel keeps
the state in its own dtype between a sequence's tokens, so a bfloat16 state is taken only
where every sequence has one token (the Triton decode kernel carries it in float32 otherwise).
``backend="auto"`` takes it only where it measured faster than Triton's: grids of many
sequence-heads (:func:`auto_refusal`); ``backend="cuda"`` takes it wherever it can.
"""

from __future__ import annotations

import torch

from kda import abi
from kda.cuda import loader
from kda.cuda.forward import FLAG_HAS_H0, FLAG_STORE_HT, _launch_context, input_flags
from kda.dispatch import note, on_device
from kda.intmath import cdiv
from kda.validation import Problem

FLAG_VARLEN = abi.FLAGS["varlen"]
FLAG_INDICES_INT64 = abi.FLAGS["indices_int64"]
FLAG_ACCEPTED_INT64 = abi.FLAGS["accepted_int64"]
STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# V columns of a CTA, and where auto takes this kernel over Triton's decode kernel: from the
# fewest (sequence, value head) pairs below, by (state dtype, pool). Measured on an H200,
# 2026-12-02, run 36 (benchmarks/results/h200-2026-12-02-decode-run36.md, graph replay, H=32,
# one token; ms, this kernel at 64 / 32 columns, then Triton's): float32 plain N=32 0.0429 /
# 0.0422 / 0.0441, N=256 0.268 / 0.273 / 0.283; float32 pools N=32 0.0451 / 0.0440 / 0.0468,
# N=256 0.271 / 0.280 / 0.317; bf16 plain N=32 0.0306 / 0.0352 / 0.0387, N=256 0.159 / 0.209 /
# 0.263 (pools 0.0312 / 0.0341 / 0.0325, 0.164 / 0.205 / 0.197). Below 1024 pairs (N=1) Triton's
# one-program latency is lower (8.2 us against 8.5 to 9.6). 64 columns win from N=256 on for
# float32 (at N=32, 4096 CTAs of 32 columns filled the SMs' waves better than 2048 of 64, until
# run 56 below). bf16 states take whole heads, 128 columns (run 39,
# results/h200-2026-12-02-decode-run39.md, graph ms at 64 / 128 columns): plain
# N=32 0.0303 / 0.0303, N=256 0.158 / 0.153, N=1024 0.581 / 0.549 (0.87 -> 0.92 of the copy
# bandwidth); pools 0.0310 / 0.0310, 0.163 / 0.158, 0.613 / 0.569. A thread's fixed work a token
# (its K index's prologue, the sums over K across warps: about half of its 1445 instructions at
# 64 columns, ncu and SASS of run 38) is then shared by twice the state bytes. float32 at 128
# columns holds three CTAs an SM by shared memory and is slower at every N. With the slice staged
# by bulk copies (2026-12-03, runs 52-54, benchmarks/NOTES.md: this kernel's builds in
# alternating processes) bf16 grids under 2048 pairs took 64 columns for a while. Since the
# first token's inputs are loaded before the staging (2026-12-03, runs 55-57, the same A/B, graph
# ms): bf16 whole heads at N=32 0.0254-0.0259 against 0.0272-0.0285 at 64 columns (N=256 0.1402
# against 0.1489), and float32 at 64 columns N=32 0.0393-0.0400 against 0.0405-0.0412 at 32
# (pools 0.0408-0.0412 against 0.0414-0.0422; N=256 0.2638 against 0.2721). So the width
# follows the state dtype alone.
DEFAULT_COLUMNS = {"float32": 64, "bfloat16": 128}
AUTO_MIN_PAIRS = {("bfloat16", False): 1024, ("bfloat16", True): 1024, ("float32", True): 1024,
                  ("float32", False): 1024}  # fmt: skip
# float32 [V, K] states without a pool (state_v_first) keep the earlier bound: at N=32 this kernel
# (32 columns) took 0.0543 ms in run 37 against Triton's 0.0406 in run 36 (the bench's layout
# row, graph replay); N=256 and 1024 ran here in both runs (0.288 and 1.100 ms in run 36).
AUTO_MIN_PAIRS_V_FIRST_FLOAT32 = 8192


def state_tensors(p: Problem) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the state read, the state written) of a call: the pool for both, or the initial state
    and (when asked for) the final state to be."""
    if p.pool is not None:
        return p.pool, p.pool
    return p.initial_state, None


def state_dtype(p: Problem) -> torch.dtype:
    """The dtype the kernel keeps the state in: the state read's, or the final state's without one."""
    h0, _ = state_tensors(p)
    return h0.dtype if h0 is not None else p.final_state_dtype


def decode_rejects(p: Problem) -> str | None:
    """What of ``p`` the decode kernel does not cover (beyond the CUDA backend's own checks of
    dtypes, head dims, the gate and the device), or None."""
    h0, _ = state_tensors(p)
    dtype = state_dtype(p)
    if dtype not in STATE_DTYPES:
        return f"a {dtype} state (the CUDA decode kernel takes float32 or bfloat16)"
    pair = (STATE_DTYPES[dtype], STATE_DTYPES.get(p.final_state_dtype))
    if p.pool is None and p.output_final_state and pair not in abi.DECODE_STATE_PAIRS:
        return (
            f"a {dtype} initial state with a {p.final_state_dtype} final state (one dtype in and out, "
            "or bfloat16 in and float32 out)"
        )
    if dtype == torch.bfloat16 and (p.T != 1 if p.cu_seqlens is None else p.lengths_unchecked or p.longest > 1):
        return "bfloat16 states over more than one token a sequence (kept in bfloat16 between tokens)"
    if h0 is not None and h0.data_ptr() % 16:
        return "a state that is not 16-byte aligned (a view at an odd offset)"
    return None


def auto_refusal(p: Problem) -> str | None:
    """Why ``backend="auto"`` should run ``p`` on Triton's decode kernel although this one takes
    it (measured slower there: AUTO_MIN_PAIRS), or None."""
    dtype = STATE_DTYPES[state_dtype(p)]
    pairs, fewest = p.N * p.HV, AUTO_MIN_PAIRS[(dtype, p.pool is not None)]
    v_first = dtype == "float32" and p.pool is None and p.state_v_first
    if v_first:
        fewest = AUTO_MIN_PAIRS_V_FIRST_FLOAT32
    if pairs < fewest:
        kind = f"{dtype} state pool" if p.pool is not None else f"{dtype} {'[V, K] ' if v_first else ''}states"
        return f"{pairs} (sequence, head) pairs of {kind} (Triton's decode kernel is faster below {fewest})"
    return None


def decode(p: Problem, columns: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``p`` (accepted by :func:`decode_rejects` and the CUDA backend) in one launch:
    ``(o, final state)``, a pool updated in place. ``columns``: V columns a CTA (one of
    abi.DECODE_COLUMNS; benchmarks compare them)."""
    kernels, device_index, stream, _ = _launch_context(p)
    o = torch.empty(p.B, p.T, p.HV, p.V, dtype=p.q.dtype, device=p.q.device)
    h0, ht = state_tensors(p)
    if p.pool is None and p.output_final_state:
        ht = torch.empty(p.state_shape, dtype=p.final_state_dtype, device=p.q.device)
    if p.N * p.HV == 0:
        return o, ht
    dtype = STATE_DTYPES[state_dtype(p)]
    columns = columns or DEFAULT_COLUMNS[dtype]
    if columns not in abi.DECODE_COLUMNS:
        raise ValueError(f"columns must be one of {abi.DECODE_COLUMNS}, got {columns}")
    idx = p.state_indices
    mode = 0 if idx is None else idx.dim()
    bits = input_flags(p)
    if h0 is not None:
        bits |= FLAG_HAS_H0
    if ht is not None:
        bits |= FLAG_STORE_HT
    if p.cu_seqlens is not None:
        bits |= FLAG_VARLEN
    if idx is not None and idx.dtype == torch.int64:
        bits |= FLAG_INDICES_INT64
    if p.accepted is not None and p.accepted.dtype == torch.int64:
        bits |= FLAG_ACCEPTED_INT64
    params = (  # loader.DecodeParams, field by field
        p.q.data_ptr(), p.k.data_ptr(), p.v.data_ptr(), p.g.data_ptr(), p.beta.data_ptr(),
        0 if p.A_log is None else p.A_log.data_ptr(), 0 if p.dt_bias is None else p.dt_bias.data_ptr(),
        0 if h0 is None else h0.data_ptr(), 0 if ht is None else ht.data_ptr(), o.data_ptr(),
        0 if p.cu_seqlens is None else p.cu_seqlens.data_ptr(), 0 if idx is None else idx.data_ptr(),
        0 if p.accepted is None else p.accepted.data_ptr(),
        p.T, p.N, p.N if p.pool is None else p.pool.shape[0], p.H, p.HV, idx.shape[1] if mode == 2 else 1, mode,
        bits, p.scale, p.lower_bound if p.lower_bound is not None else 0.0, 2.0 if p.allow_neg_eigval else 1.0,
    )  # fmt: skip
    final = STATE_DTYPES[ht.dtype] if ht is not None and p.pool is None else dtype
    name = loader.DECODE_KERNELS[(dtype, final, p.state_v_first, columns)]
    with on_device(device_index), kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_decode_params(params)
        kernels.launch(name, (cdiv(p.V, columns) * p.N * p.HV, 1), abi.DECODE_THREADS, 0, stream, "decode")
    note("cuda:pooled_decode" if p.pool is not None else "cuda:decode")
    return o, ht
