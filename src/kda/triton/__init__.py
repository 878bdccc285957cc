"""The ``triton`` backend: the chunk-16 forward as two Triton stages, and its backward.

:mod:`kda.triton.prepare` (token-parallel) writes per-chunk operands; the recurrence of
:mod:`kda.triton.recurrence` runs each sequence's chunks in order with the V dimension split
across programs. :func:`chunk_forward` runs both; ``fused_recurrent_kda`` uses the same
kernels (a chunk may hold a single token). Calls whose inputs require grad go through the
custom op of :mod:`kda.autograd`, whose forward saves state checkpoints and whose backward
is :mod:`kda.triton.training` (stages :mod:`kda.triton.state_grad`, :mod:`kda.triton.chunk_grad`).
"""

from __future__ import annotations

from functools import cache

import torch

from kda.dispatch import POOL_TRACED, note, on_device_of, prefers_decode, through_op, traced
from kda.tables import chunk_tables
from kda.triton.common import interpreter_fault, interpreting
from kda.triton.prepare import prepare_chunks
from kda.triton.recurrence import recurrence_v_split
from kda.validation import Problem

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@cache
def cuda_visible() -> bool:
    """torch.cuda.is_available(), asked once: it does not change within a process, and the
    dispatch asks on every call."""
    return torch.cuda.is_available()


def precision_for(dtype: torch.dtype) -> tuple[torch.dtype, str, bool]:
    """(workspace dtype, dot precision, mixed state dots) for an input dtype.

    16-bit inputs: operands stored in that dtype; A, M and w products in tf32; the state
    products with both operands in that dtype (fp32 accumulate). Measured on an H200
    (benchmarks/NOTES.md): tf32 state products cost 0.82x fla's time against 0.65x, for
    an error that is below fla's either way.
    float32 inputs: float32 workspace and tf32x3 products (float32 accuracy, 1e-4 bar).
    """
    if dtype == torch.float32:
        return torch.float32, "tf32x3", False
    return dtype, "tf32", True


def chunk_forward(p: Problem, checkpoints: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run both stages: ``(o, final state or None)``. ``checkpoints`` (the training
    forward's, :func:`kda.triton.training.train_forward`) also receives the state checkpoints."""
    o = torch.empty_like(p.v, dtype=p.q.dtype)
    ht = torch.empty(p.state_shape, dtype=p.final_state_dtype, device=p.q.device) if p.output_final_state else None
    return run_stages(p, o, ht, checkpoints=checkpoints)


def run_stages(
    p: Problem,
    o: torch.Tensor,
    ht: torch.Tensor | None,
    workspace_dtype: torch.dtype | None = None,
    mixed: bool | None = None,
    checkpoints: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both stages into given outputs (tests poison them first). ``workspace_dtype`` and
    ``mixed`` override :func:`precision_for` (benchmarks/variants.py compares them)."""
    default_dtype, dot_precision, default_mixed = precision_for(p.q.dtype)
    workspace_dtype = workspace_dtype or default_dtype
    mixed = default_mixed if mixed is None else mixed
    tables = chunk_tables(p)
    ws = prepare_chunks(p, tables, workspace_dtype, dot_precision)
    note("triton:prepare_chunks")
    recurrence_v_split(p, tables, ws, o, ht, mixed, dot_precision, checkpoints)
    note("triton:recurrence_v_split")
    return o, ht


class TritonBackend:
    name = "triton"
    training = "forward and backward"

    def availability(self) -> str | None:
        if interpreting():
            return interpreter_fault()
        if not cuda_visible():
            return "no CUDA GPU visible to torch (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
        return None

    def rejects(self, p: Problem) -> str | None:
        if p.pool is not None and traced(p):
            return POOL_TRACED
        if p.q.dtype not in SUPPORTED_DTYPES:
            return f"dtype {p.q.dtype} (needs float16, bfloat16 or float32)"
        if p.q.device.type != "cuda" and not (interpreting() and p.q.device.type == "cpu"):
            return f"tensors on {p.q.device} (needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)"
        return None

    def auto_rejects(self, p: Problem) -> str | None:
        if p.q.device.type != "cuda":
            return (f"tensors on {p.q.device}: the Triton interpreter runs them far slower than the torch backend "
                    "(backend='triton' runs it anyway)")  # fmt: skip
        return None

    def run(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
        if p.pool is not None or prefers_decode(p):  # one launch, no tables (a pool: in place)
            from kda.triton.decode import decode

            with on_device_of(p.q):  # Triton launches on the current device, not the tensors'
                o, ht = decode(p)
            note("triton:pooled_decode" if p.pool is not None else "triton:decode")
            return o, ht
        if through_op(p):
            # Through the custom op (dispatch.through_op says why). The op makes the device
            # current itself; dynamo would trace a guard here.
            from kda.autograd import chunk_kda_trainable

            return chunk_kda_trainable(p)
        with on_device_of(p.q):
            return chunk_forward(p)


BACKEND = TritonBackend()
