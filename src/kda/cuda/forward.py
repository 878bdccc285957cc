"""The CUDA forward: fill the parameter block from a checked Problem, launch K1 then K2."""

from __future__ import annotations

import os

import torch

from kda.cuda import loader
from kda.dispatch import note
from kda.triton.common import chunk_tables
from kda.validation import Problem

SMS_FOR_SPLIT = 132  # H200; only steers the choice of CTA width below


def recurrence_warps(pairs: int) -> int:
    """CTA width of the recurrence (16 V rows per warp): narrow CTAs when few
    (sequence, head) pairs must fill the GPU, wide ones when there are plenty.
    ``KDA_CUDA_WARPS`` overrides it (experiments)."""
    if os.environ.get("KDA_CUDA_WARPS"):
        warps = os.environ["KDA_CUDA_WARPS"]
        if warps not in ("1", "2", "4"):
            raise ValueError(f"KDA_CUDA_WARPS must be 1, 2 or 4 (warps per recurrence CTA), got {warps!r}")
        return int(warps)
    ctas_at_two_warps = pairs * (loader.HEAD_DIM // 32)
    if ctas_at_two_warps < 2 * SMS_FOR_SPLIT:
        return 1
    if ctas_at_two_warps >= 8 * SMS_FOR_SPLIT:
        return 4
    return 2


def workspace_bytes(p: Problem) -> int:
    return max(chunk_tables(p).num_chunks, 1) * p.H * loader.WORKSPACE_BYTES


def chunk_forward(
    p: Problem,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    run_prepare: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run K1 and K2 for a problem the backend accepted. ``out`` / ``final_state_out`` may
    be given (tests poison them first); so may ``workspace`` (uint8, ``workspace_bytes(p)``),
    which tests read through ``loader.workspace_views``, or fill and pass with
    ``run_prepare=False`` to test K2 alone."""
    kernels = loader.kernels()
    device = p.q.device
    kernels.configure(device.index if device.index is not None else torch.cuda.current_device())
    o = torch.empty_like(p.v) if out is None else out
    ht = None
    if p.output_final_state:
        ht = (
            torch.empty(p.state_shape, dtype=torch.float32, device=device)
            if final_state_out is None
            else final_state_out
        )
    tables = chunk_tables(p)
    if workspace is None:
        workspace = torch.empty(workspace_bytes(p), dtype=torch.uint8, device=device)

    flags = loader.FLAGS
    bits = 0
    if p.gate_form == "lower_bound":
        bits |= flags["gate_lower_bound"]
        bits |= flags["has_A_log"] if p.A_log is not None else 0
        bits |= flags["has_dt_bias"] if p.dt_bias is not None else 0
    bits |= flags["l2norm"] if p.use_qk_l2norm else 0
    bits |= flags["beta_sigmoid"] if p.use_beta_sigmoid else 0
    bits |= flags["has_h0"] if p.initial_state is not None else 0
    bits |= flags["store_ht"] if ht is not None else 0
    bits |= flags["state_v_first"] if p.state_v_first else 0
    bits |= flags["g_float32"] if p.g.dtype == torch.float32 else 0
    bits |= flags["beta_float32"] if p.beta.dtype == torch.float32 else 0

    def address(x: torch.Tensor | None) -> int:
        return 0 if x is None else x.data_ptr()

    warps = recurrence_warps(p.N * p.H)
    stream = torch.cuda.current_stream(device).cuda_stream
    # torch.cuda.device makes the device's primary context (torch's) current for the driver calls.
    with torch.cuda.device(device), kernels.lock:
        prm = kernels.params
        prm.q, prm.k, prm.v, prm.g, prm.beta = (x.data_ptr() for x in (p.q, p.k, p.v, p.g, p.beta))
        prm.A_log, prm.dt_bias, prm.h0 = address(p.A_log), address(p.dt_bias), address(p.initial_state)
        prm.ht, prm.o, prm.workspace = address(ht), o.data_ptr(), workspace.data_ptr()
        prm.seq_offsets, prm.chunk_offsets = tables.seq_offsets.data_ptr(), tables.chunk_offsets.data_ptr()
        prm.chunk_seq, prm.seq_order = tables.chunk_seq.data_ptr(), tables.seq_order.data_ptr()
        prm.num_chunks, prm.num_seqs, prm.heads, prm.flags = tables.num_chunks, p.N, p.H, bits
        prm.scale = p.scale
        prm.lower_bound = p.lower_bound if p.lower_bound is not None else 0.0
        prm.beta_scale = 2.0 if p.allow_neg_eigval else 1.0
        if tables.num_chunks and run_prepare:
            kernels.launch("kda_prepare", (tables.num_chunks, p.H), loader.PREPARE_THREADS, 0, stream)
            note("cuda:prepare")
        grid = (loader.HEAD_DIM // (16 * warps) * p.N * p.H, 1)
        kernels.launch(f"kda_recurrence_w{warps}", grid, 32 * warps, loader.stage_bytes(warps), stream)
        note("cuda:recurrence")
    return o, ht
