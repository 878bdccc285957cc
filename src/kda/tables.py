"""The chunk tables both chunk backends read: where every 16-token chunk lives. Built on the
device, from ``cu_seqlens`` as it is there, by one kernel launch: no host copy of the
lengths, no host synchronisation, nothing shared between threads, and a CUDA-graph capture
records the build, so a replay with new lengths in ``cu_seqlens`` gets their tables.

The CUDA path builds them with its own kernel (prepare.cu ``kda_build_tables``), launched
through kda.cuda.loader like its other kernels: on the H200 (2026-12-04, benchmarks/host_parts.py)
the Triton launch took 59 us of host time of a tiny call's 150, a direct cuda-python launch about
6. The Triton backend, and any caller without the CUDA kernels, launch ``build_tables_kernel``
(kda/triton/tables.py, imported at its first launch, so the CUDA path does not import Triton
for its tables). Both write the same tables, bit for bit.

The launch grid cannot wait for the lengths, so the tables have room for the most chunks
the shapes allow (:func:`chunk_slots`); slots past the call's real chunks belong to no
tokens, and the kernels that walk chunk slots skip them. Offsets are clamped into
``[0, T]`` and made non-decreasing as they are read (valid ones are unchanged), so no
``cu_seqlens`` can send a kernel outside its tensors, whatever a graph replay puts there.
"""

from __future__ import annotations

from functools import cache, cached_property

import torch

from kda import abi
from kda.intmath import next_power_of_2

CHUNK = abi.CHUNK  # tokens per chunk
DOT_MIN = 16  # tl.dot's smallest M, N and K: a block that feeds a dot is at least this wide
CHECKPOINT_CHUNKS = abi.CHECKPOINT_CHUNKS  # chunks between the training forward's saved states
# The longest-first order of the CUDA recurrence's schedule is ranked for up to this many
# sequences (abi.ORDER_MAX says why); past it, both builders take them as they come.
ORDER_MAX = abi.ORDER_MAX
# The CUDA builder's flag bits (TablesParams::flags)
FLAG_VARLEN = abi.FLAGS["varlen"]
FLAG_RANK_BY_LENGTH = abi.FLAGS["rank_by_length"]
FLAG_CU_SEQLENS_INT32 = abi.FLAGS["cu_seqlens_int32"]
# Batched layouts depend on the shapes alone: their tables are kept, for this many (shape,
# stream) pairs (then built per call). Never evicted, so no kernel still queued can see them
# freed; kept per stream, so no call on another stream can read them before their build ran.
BATCHED_CACHED = 64


def chunk_slots(B: int, T: int, N: int, varlen: bool) -> int:
    """Chunk slots of a call, from its shapes alone: exact for B sequences of T tokens; for N
    packed sequences of T tokens in all an upper bound, as sum_n ceil(L_n / 16) <= (T + 15 N) / 16."""
    if not varlen:
        return B * -(-T // CHUNK)
    return (T + (CHUNK - 1) * N) // CHUNK


def checkpoint_rows(B: int, T: int, N: int, varlen: bool) -> int:
    """Rows of the checkpoint tensor, from the shapes alone (the fake of the training op must
    know it without the sequence lengths): exact for B sequences of T tokens; for N packed
    sequences an upper bound, as sum_n ceil(L_n / 64) <= ceil(T / 64) + N."""
    span = CHUNK * CHECKPOINT_CHUNKS
    if not varlen:
        return B * -(-T // span)
    return -(-T // span) + N


class ChunkTables:
    """Where every chunk lives. Batched inputs are treated as N = B packed sequences.

    ``seq_offsets [N+1]``: token offsets (``cu_seqlens``, clamped); ``chunk_offsets [N+1]``:
    first chunk of each sequence; ``chunk_seq [num_chunks]``: sequence of each chunk slot (the
    last sequence for slots past the real chunks: they start past its end); ``seq_order
    [N*H]``: the (sequence, head) pairs as ``n * H + h``, longest sequence first (the CUDA
    recurrence's schedule: the longest chains start first, short ones fill in behind);
    ``checkpoint_offsets [N+1]``: first checkpoint row of each sequence (training). All int64,
    in one tensor ``packed`` in the order seq_offsets, chunk_offsets, checkpoint_offsets,
    chunk_seq, seq_order. ``num_chunks``: chunk slots (:func:`chunk_slots`), what grids and
    workspaces are sized by. ``addresses``: the device addresses of seq_offsets, chunk_offsets,
    chunk_seq and seq_order in that order (the CUDA launch's), ``checkpoint_address`` that of
    checkpoint_offsets: computed from ``packed``'s, so the CUDA path makes no view of it (five
    views cost about 7 us of host time a call, 2026-12-04); the tables themselves are views made
    at their first use."""

    def __init__(self, packed: torch.Tensor, num_seqs: int, num_chunks: int, BK: int):
        self.packed, self.num_seqs, self.num_chunks, self.BK = packed, num_seqs, num_chunks, BK
        n1 = num_seqs + 1
        # Where each table starts in ``packed`` (elements), in its order, then seq_order's end:
        # the one account of the layout, which the addresses and the views both read.
        self.starts = starts = (0, n1, 2 * n1, 3 * n1, 3 * n1 + num_chunks, packed.numel())
        base, item = packed.data_ptr(), packed.element_size()
        self.addresses = (base, base + starts[1] * item, base + starts[3] * item, base + starts[4] * item)
        self.checkpoint_address = base + starts[2] * item

    def _table(self, i: int) -> torch.Tensor:
        return self.packed[self.starts[i] : self.starts[i + 1]]

    @cached_property
    def seq_offsets(self) -> torch.Tensor:
        return self._table(0)

    @cached_property
    def chunk_offsets(self) -> torch.Tensor:
        return self._table(1)

    @cached_property
    def checkpoint_offsets(self) -> torch.Tensor:
        return self._table(2)

    @cached_property
    def chunk_seq(self) -> torch.Tensor:
        return self._table(3)

    @cached_property
    def seq_order(self) -> torch.Tensor:
        return self._table(4)


_BATCHED: dict[tuple, ChunkTables] = {}


def chunk_tables(p, capturing: bool | None = None, kernels=None, stream: int | None = None) -> ChunkTables:
    """The tables of ``p`` (a checked Problem), built on its device by one launch on the current
    stream; batched layouts are kept per stream (:data:`BATCHED_CACHED`). ``capturing``: whether
    the current stream is being captured, if the caller knows (tables built in a capture live
    in its graph's pool, so they are not kept). ``kernels`` and ``stream``: the CUDA path's
    loaded kernels (kda.cuda.loader.Kernels) and the current stream's raw handle, with which
    :func:`build_tables` launches the CUDA builder."""
    varlen = p.cu_seqlens is not None
    key = None
    if not varlen:
        if stream is None:
            stream = torch.cuda.current_stream(p.q.device).cuda_stream if p.q.is_cuda else 0
        key = (p.q.device, stream, p.B, p.T, p.H, p.K)
        tables = _BATCHED.get(key)
        if tables is not None:
            return tables
    tables = build_tables(p, kernels, stream)
    if key is not None and len(_BATCHED) < BATCHED_CACHED:
        if capturing is None:
            capturing = p.q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _BATCHED[key] = tables
    return tables


def build_tables(p, kernels=None, stream: int | None = None) -> ChunkTables:
    """The tables of ``p`` in one int64 tensor, by one launch: of prepare.cu's
    ``kda_build_tables`` on ``stream`` where ``kernels`` (kda.cuda.loader.Kernels) are given and
    the tensors are on a GPU; else of the Triton kernel (kda/triton/tables.py) on the current
    stream; on the CPU outside the interpreter, where no kernel can run, the same tables by
    torch (:func:`_host_tables`)."""
    varlen = p.cu_seqlens is not None
    N = p.N
    slots = chunk_slots(p.B, p.T, N, varlen)
    packed = torch.empty(3 * (N + 1) + slots + N * p.H, dtype=torch.int64, device=p.q.device)
    tables = ChunkTables(packed, N, slots, max(next_power_of_2(p.K), DOT_MIN))
    rank = varlen and N <= ORDER_MAX
    if not N:
        packed[: 3 * (N + 1)].zero_()
    elif kernels is not None and p.q.is_cuda:
        if stream is None:  # (a null handle would be the legacy default stream, not torch's current one)
            stream = torch.cuda.current_stream(p.q.device).cuda_stream
        _launch_cuda_builder(p, tables, rank, kernels, stream)
    elif p.q.is_cpu and not _interpreting():
        _host_tables(p, tables)
    else:
        _triton_builder()(p, tables, rank)
    return tables


def _launch_cuda_builder(p, tables: ChunkTables, rank: bool, kernels, stream: int) -> None:
    """Fill the loader's TablesParams block for ``p`` and launch ``kda_build_tables`` on
    ``stream``: one CTA for the offsets tables, then the slot and sequence blocks (abi.tables_grid)."""
    cu = p.cu_seqlens
    flags = 0
    if cu is not None:
        flags = FLAG_VARLEN | (FLAG_RANK_BY_LENGTH if rank else 0)
        if cu.dtype == torch.int32:
            flags |= FLAG_CU_SEQLENS_INT32
    N, slots = p.N, tables.num_chunks
    params = (  # loader.TablesParams, field by field
        0 if cu is None else cu.data_ptr(), *tables.addresses, tables.checkpoint_address,
        slots, N, p.T, 0 if cu is not None else p.T, p.H, flags,
    )  # fmt: skip
    device_index = p.q.get_device()
    with kernels.lock:
        kernels.bind_context(device_index)
        kernels.set_tables_params(params)
        kernels.launch(abi.TABLES_KERNEL, (abi.tables_grid(slots, N), 1), abi.TABLES_THREADS, 0, stream, "tables")


@cache
def _triton_builder():
    """kda.triton.tables.launch_build_tables, imported once, at its first launch (kda.tables
    itself imports no Triton)."""
    from kda.triton.tables import launch_build_tables

    return launch_build_tables


def _interpreting() -> bool:
    from kda.triton.common import interpreting

    return interpreting()


def _host_tables(p, tables: ChunkTables) -> None:
    """The builders' tables by torch ops, for CPU tensors outside the interpreter (tests that
    fake the CUDA launch on the CPU)."""
    N = p.N
    seq_offsets, chunk_offsets, checkpoint_offsets = tables.seq_offsets, tables.chunk_offsets, tables.checkpoint_offsets
    chunk_seq, seq_order = tables.chunk_seq, tables.seq_order
    if p.cu_seqlens is None:
        offsets = torch.arange(N + 1, dtype=torch.int64) * p.T
    else:
        offsets = torch.cummax(p.cu_seqlens.long().clamp(0, p.T), 0).values
    seq_offsets.copy_(offsets)
    lengths = offsets[1:] - offsets[:-1]
    counts = (lengths + CHUNK - 1) // CHUNK
    chunk_offsets[0] = checkpoint_offsets[0] = 0
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    torch.cumsum((counts + CHECKPOINT_CHUNKS - 1) // CHECKPOINT_CHUNKS, 0, out=checkpoint_offsets[1:])
    owners = torch.searchsorted(chunk_offsets[1:], torch.arange(chunk_seq.numel()), right=True)
    chunk_seq.copy_(owners.clamp(max=N - 1))
    ranked = p.cu_seqlens is not None and N <= ORDER_MAX
    order = torch.argsort(lengths, descending=True, stable=True) if ranked else torch.arange(N)
    seq_order.copy_((order[:, None] * p.H + torch.arange(p.H)[None, :]).reshape(-1))
