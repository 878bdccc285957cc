"""The training backward's reverse chain on the CUDA path (recurrence.cu's
``kda_state_grad_chain_w*``): K1 writes the call's workspace, then the chain runs over it from
each sequence's last chunk to its first, writing what ``kda/triton/state_grad.py``'s chain
writes (the gradient of the state leaving every chunk, bf16 ``[num_chunks, H, V, K]``, and of
the initial state, float32).

A training backward after a CUDA forward takes it (``kda.triton.training.cuda_chain_refusal``;
``KDA_CUDA_BACKWARD_CHAIN=0`` turns it off): K1 and this chain in place of the Triton prepare
stage and chain, then the state products (:func:`state_products`, recurrence.cu's
``kda_state_products``; ``KDA_CUDA_STATE_PRODUCTS=0``: the Triton kernels) and the Triton
prepare-backwards kernel, both reading K1's workspace (``k1_operands``). On an H200 (2026-12-02,
runs 38-39, benchmarks/NOTES.md) the chain matched Triton's chunk by chunk under NaN poison, ran
clean under compute-sanitizer, and took the 1x8192 H32 training step from 4.59 to 4.40 ms; the
state products took it to 3.44 ms (run 43).
"""

from __future__ import annotations

import torch

from kda import abi
from kda.cuda import loader
from kda.cuda.forward import (
    _launch_context,
    chain_grid,
    chunk_params,
    input_flags,
    prepare_kernel,
    sm_count,
    state_flags,
    workspace_bytes,
)
from kda.dispatch import note, on_device
from kda.tables import chunk_tables
from kda.validation import Problem

# Consumer warps per chain CTA (abi.CHAIN_WIDTHS): K2's choice for few (sequence, head) pairs,
# which training calls are; the one width timed for the chain (0.45 ms on 1x8192 H32, run 39).
CHAIN_WARPS = 2


def k1_operands(workspace: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views of K1's workspace (uint8, blocks of loader.WORKSPACE_BYTES per (chunk, head)),
    each starting at its field in the first block, as ``kda.triton.chunk_grad``'s K1_LAYOUT
    kernels read them (a block further on is chunk_grad.K1_BLOCK_BF16 / K1_BLOCK_F32 elements):
    q_decayed, w, k_restored (swizzled tiles), inverse_beta (its bf16 part), inverse_beta_lo, M
    (bf16) and gamma (float32)."""
    views = {}
    for name, (offset, dtype, _shape) in loader.WORKSPACE_FIELDS.items():
        views["inverse_beta" if name == "inverse_beta_hi" else name] = workspace[offset:].view(getattr(torch, dtype))
    return views


def dstates_row_major(dstates: torch.Tensor) -> torch.Tensor:
    """The CUDA chain's ``dstates`` (rows of each [V, K] block swizzled as K1's tiles,
    kda_cuda.cuh tile_offset) in plain row-major order, as the Triton chain writes them."""
    *lead, v, k = dstates.shape
    return loader.swizzle_tiles(dstates.reshape(*lead, v // 16, 16, k)).reshape(dstates.shape)


def state_grad_chain(
    p: Problem,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    dh0: torch.Tensor | None,
    dstates: torch.Tensor,
    tables=None,
) -> torch.Tensor:
    """K1 and the reverse chain for ``p`` (a problem the CUDA backend takes): ``do`` the output
    gradient (bf16, v's shape), ``dht`` the final state's (float32 or bf16, the state's layout)
    or None for zero. Writes ``dstates`` (bf16 ``[num_chunks, H, V, K]`` of ``p``'s chunk
    tables, each (chunk, head) block's rows swizzled as K1's tiles: :func:`dstates_row_major`
    undoes it; ``tables``: those tables if already at hand) and, when given, ``dh0`` (float32,
    the state's layout). Returns K1's workspace."""
    if do.dtype != torch.bfloat16 or do.shape != p.v.shape:
        raise ValueError(f"do must be bfloat16 of v's shape {tuple(p.v.shape)}, got {do.dtype} {tuple(do.shape)}")
    if dht is not None and (dht.dtype not in (torch.float32, torch.bfloat16) or dht.shape != p.state_shape):
        raise ValueError(
            f"dht must be float32 or bfloat16 of shape {p.state_shape}, got {dht.dtype} {tuple(dht.shape)}"
        )
    if dh0 is not None and (dh0.dtype != torch.float32 or dh0.shape != p.state_shape):
        raise ValueError(f"dh0 must be float32 of shape {p.state_shape}, got {dh0.dtype} {tuple(dh0.shape)}")
    kernels, device_index, stream, capturing = _launch_context(p)
    if tables is None:
        with on_device(device_index):
            tables = chunk_tables(p, capturing, kernels, stream)
    num_chunks, N, H = tables.num_chunks, p.N, p.H
    if dstates.dtype != torch.bfloat16 or tuple(dstates.shape) != (num_chunks, H, p.V, p.K):
        raise ValueError(f"dstates must be bfloat16 [{num_chunks}, {H}, {p.V}, {p.K}], got {tuple(dstates.shape)}")
    workspace = p.q.new_empty(workspace_bytes(p, tables), dtype=torch.uint8)
    if N * H == 0:
        return workspace
    do, dht = do.contiguous(), None if dht is None else dht.contiguous()
    bits = input_flags(p) | state_flags(p, dht, dh0)  # dh0 is float32: no ht_bfloat16
    # loader.Params as the chain reads it: v = dO, h0 = dht, ht = dh0, checkpoints = dstates
    params = chunk_params(p, do, dht, dh0, None, workspace, tables, dstates, bits)
    with on_device(device_index), kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_params(params)
        if num_chunks:
            kernels.launch(prepare_kernel(p), (num_chunks, H), loader.PREPARE_THREADS, 0, stream)
            note("cuda:prepare")
        name, shared_bytes = loader.CHAIN_KERNELS[CHAIN_WARPS]
        grid = (chain_grid(CHAIN_WARPS, N * H), 1)
        kernels.launch(name, grid, 32 * (CHAIN_WARPS + 1), shared_bytes, stream)
        note("cuda:state_grad_chain")
    return workspace


def product_scratch_numel(num_chunks: int, heads: int) -> int:
    """Float32 elements of the scratch :func:`state_products` writes (and the Triton
    local-gradient kernels share, kda.triton.chunk_grad.local_products): dQ~, dw, dK^ ``[3,
    num_chunks, H, 16, 128]``, dU V^T and dO V^T ``[2, num_chunks, H, 16, 16]``, dgamma
    ``[num_chunks, H, 128]``, back to back (kda.triton.chunk_grad.scratch_views)."""
    from kda.triton.chunk_grad import scratch_numel

    return scratch_numel(num_chunks, heads, abi.HEAD_DIM)


def state_products(
    p: Problem,
    do: torch.Tensor,
    checkpoints: torch.Tensor,
    dstates: torch.Tensor,
    workspace: torch.Tensor,
    tables,
    scratch: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """The state products of the backward's local gradients on K1's ``workspace``
    (recurrence.cu ``kda_state_products``: a CTA an SM, each taking (checkpoint span, head)
    items in turn), after
    :func:`state_grad_chain`: reads ``do`` (bf16, v's shape), the training forward's
    ``checkpoints`` (float32 ``[rows, H, V, K]``) and the chain's ``dstates`` (bf16
    ``[num_chunks, H, V, K]``, rows swizzled as K1's tiles); writes ``scratch``
    (:func:`product_scratch_numel`) and ``dv`` (v's shape and dtype), what
    kda.triton.chunk_grad's state and dU kernels write."""
    from kda.cuda import ALIGNMENT
    from kda.triton.training import checkpoint_shape

    num_chunks, H, shape = tables.num_chunks, p.H, tuple(p.v.shape)
    if p.K != abi.HEAD_DIM or p.V != abi.HEAD_DIM or p.HV != H:
        raise ValueError(f"the state products take K = V = {abi.HEAD_DIM} and HV = H, got K={p.K} V={p.V} HV={p.HV}")
    expected = {  # name -> (tensor, dtype, shape or None for a flat size check below)
        "do": (do, torch.bfloat16, shape),
        "dv": (dv, torch.bfloat16, shape),
        "dstates": (dstates, torch.bfloat16, (num_chunks, H, p.V, p.K)),
        "checkpoints": (checkpoints, torch.float32, checkpoint_shape(p)),
        "scratch": (scratch, torch.float32, (product_scratch_numel(num_chunks, H),)),
        "workspace": (workspace, torch.uint8, None),
    }
    for name, (x, dtype, want) in expected.items():
        if x.dtype != dtype or (want is not None and tuple(x.shape) != tuple(want)):
            raise ValueError(f"{name} must be {dtype} of shape {want}, got {x.dtype} {tuple(x.shape)}")
        if x.device != p.v.device:
            raise ValueError(f"{name} must be on {p.v.device}, got {x.device}")
        # (bulk copies read do, dstates and the workspace; dv takes 16-byte stores)
        if not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
            raise ValueError(f"{name} must be contiguous and {ALIGNMENT}-byte aligned")
    if workspace.numel() < workspace_bytes(p, tables):
        raise ValueError(f"workspace must hold {workspace_bytes(p, tables)} bytes (K1's), got {workspace.numel()}")
    rows = checkpoints.shape[0]
    if rows * H == 0:
        return
    kernels, device_index, stream, _capturing = _launch_context(p)
    params = chunk_params(p, p.v, dstates, scratch, dv, workspace, tables, checkpoints, 0, q=do)
    name, shared_bytes = loader.PRODUCTS_KERNEL
    with on_device(device_index), kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_params(params)
        # one CTA an SM (its shared memory), each taking (checkpoint row, head) items in turn
        kernels.launch(name, (min(rows * H, sm_count(device_index)), 1), loader.PRODUCT_THREADS, shared_bytes, stream)
        note("cuda:state_products")
