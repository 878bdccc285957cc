"""Pieces both Triton stages share: the chunk size, autotune configs and the chunk tables."""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton

CHUNK = 16


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_configs(params: list[dict], warps: tuple[int, ...], stages: tuple[int, ...]) -> list[triton.Config]:
    """Every combination of ``params`` x warps x stages. Only the first (the first listed
    value of each) under the interpreter, which cannot time kernels, or with
    ``KDA_TRITON_AUTOTUNE=0`` (test runs that would otherwise tune dozens of shapes)."""
    combos = list(itertools.product(params, warps, stages))
    if interpreting() or os.environ.get("KDA_TRITON_AUTOTUNE", "1") == "0":
        combos = combos[:1]
    return [triton.Config(dict(kw), num_warps=nw, num_stages=ns) for kw, nw, ns in combos]


@dataclass
class ChunkTables:
    """Where every chunk lives. Batched inputs are treated as N = B packed sequences.

    ``seq_offsets [N+1]`` (int64): token offsets; ``chunk_offsets [N+1]`` (int64): first
    global chunk of each sequence; ``chunk_seq [NC]`` (int32): sequence of each chunk.
    """

    seq_offsets: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_seq: torch.Tensor
    num_chunks: int
    BK: int


class LayoutCache:
    """Small LRU cache of device tensors derived from a problem's layout (device, shape and
    sequence lengths). A repeated call then moves nothing from the host: less host time,
    and the call can be captured in a CUDA graph once it has run eagerly."""

    def __init__(self, size: int = 64):
        self.size = size
        self.entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, p, build):
        offsets = None if p.cu_seqlens_cpu is None else tuple(p.cu_seqlens_cpu.tolist())
        key = (str(p.q.device), p.B, p.T, p.H, p.K, offsets)
        if key in self.entries:
            self.entries.move_to_end(key)
        else:
            self.entries[key] = build(p)
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return self.entries[key]


_TABLES = LayoutCache()


def chunk_tables(p) -> ChunkTables:
    """The tables of ``p``, built once per layout (:class:`LayoutCache`)."""
    return _TABLES.get(p, _build_chunk_tables)


def _build_chunk_tables(p) -> ChunkTables:
    """Build the tables on the host from host offsets (validation keeps a CPU copy of
    ``cu_seqlens``, so this costs no device sync) and copy them in one transfer."""
    offsets = torch.arange(p.B + 1, dtype=torch.int64) * p.T if p.cu_seqlens is None else p.cu_seqlens_cpu
    counts = (offsets[1:] - offsets[:-1] + CHUNK - 1) // CHUNK
    chunk_offsets = torch.zeros_like(offsets)
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    num_chunks = int(chunk_offsets[-1])
    chunk_seq = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), counts)
    packed = torch.cat([offsets, chunk_offsets, chunk_seq]).to(p.q.device, non_blocking=True)
    N = len(counts)
    return ChunkTables(
        seq_offsets=packed[: N + 1],
        chunk_offsets=packed[N + 1 : 2 * N + 2],
        chunk_seq=packed[2 * N + 2 :],
        num_chunks=num_chunks,
        BK=max(triton.next_power_of_2(p.K), CHUNK),
    )
