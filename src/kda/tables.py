"""The chunk tables both chunk backends read: where every 16-token chunk lives. Built on the
device, from ``cu_seqlens`` as it is there, by one kernel launch: no host copy of the
lengths, no host synchronisation, nothing shared between threads, and a CUDA-graph capture
records the build, so a replay with new lengths in ``cu_seqlens`` gets their tables.

The launch grid cannot wait for the lengths, so the tables have room for the most chunks
the shapes allow (:func:`chunk_slots`); slots past the call's real chunks belong to no
tokens, and the kernels that walk chunk slots skip them. Offsets are clamped into
``[0, T]`` and made non-decreasing as they are read (valid ones are unchanged), so no
``cu_seqlens`` can send a kernel outside its tensors, whatever a graph replay puts there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda import abi
from kda.intmath import cdiv, next_power_of_2

CHUNK = abi.CHUNK  # tokens per chunk
_ROWS = tl.constexpr(CHUNK)  # the same, as the kernels may read it
DOT_MIN = 16  # tl.dot's smallest M, N and K: a block that feeds a dot is at least this wide
CHECKPOINT_CHUNKS = abi.CHECKPOINT_CHUNKS  # chunks between the training forward's saved states
# Sequences and chunk slots per program of the builder (its matrices are BLOCK x BLOCK).
BLOCK = 64
# The longest-first order of the CUDA recurrence's schedule is ranked for up to this many
# sequences (the ranking is quadratic); more sequences fill the GPU whatever their order, so
# beyond it they are taken as they come.
ORDER_MAX = 4096
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


@dataclass
class ChunkTables:
    """Where every chunk lives. Batched inputs are treated as N = B packed sequences.

    ``seq_offsets [N+1]``: token offsets (``cu_seqlens``, clamped); ``chunk_offsets [N+1]``:
    first chunk of each sequence; ``chunk_seq [num_chunks]``: sequence of each chunk slot (the
    last sequence for slots past the real chunks: they start past its end); ``seq_order
    [N*H]``: the (sequence, head) pairs as ``n * H + h``, longest sequence first (the CUDA
    recurrence's schedule: the longest chains start first, short ones fill in behind);
    ``checkpoint_offsets [N+1]``: first checkpoint row of each sequence (training). All int64.
    ``num_chunks``: chunk slots (:func:`chunk_slots`), what grids and workspaces are sized by.
    ``addresses``: the first four tables' device addresses in that order (the CUDA launch's).
    """

    seq_offsets: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_seq: torch.Tensor
    seq_order: torch.Tensor
    checkpoint_offsets: torch.Tensor
    num_chunks: int
    BK: int
    addresses: tuple[int, int, int, int] = (0, 0, 0, 0)

    def __post_init__(self):
        self.addresses = tuple(
            x.data_ptr() for x in (self.seq_offsets, self.chunk_offsets, self.chunk_seq, self.seq_order)
        )


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sequences(cu_seqlens, n0, N, T, T_EACH, carry, VARLEN: tl.constexpr, BLOCK: tl.constexpr):
    """Sequences ``n0 .. n0 + BLOCK``: ``(n, start, end, chunks)``, start and end clamped into
    [0, T] and non-decreasing (``carry``: the largest offset before n0; valid offsets pass
    unchanged), chunks 0 past N."""
    n = n0 + tl.arange(0, BLOCK)
    if VARLEN:
        x = tl.load(cu_seqlens + n, mask=n <= N, other=T)
        x = tl.minimum(tl.maximum(x, 0), T)
        start = tl.maximum(tl.associative_scan(x, 0, _maximum), carry)
        y = tl.load(cu_seqlens + n + 1, mask=n < N, other=T)
        end = tl.maximum(tl.minimum(tl.maximum(y, 0), T), start)
    else:  # B sequences of T_EACH tokens
        start = tl.minimum(n, N).to(tl.int64) * T_EACH
        end = tl.minimum(n + 1, N).to(tl.int64) * T_EACH
    chunks = tl.where(n < N, (end - start + _ROWS - 1) // _ROWS, 0)
    return n, start, end, chunks


@triton.jit
def build_tables_kernel(
    cu_seqlens, seq_offsets, chunk_offsets, chunk_seq, seq_order, checkpoint_offsets,
    N, T, T_EACH, H, SLOTS,
    VARLEN: tl.constexpr, RANK: tl.constexpr, CHECKPOINT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program 0: the offsets tables. The next ``cdiv(SLOTS, BLOCK)``: ``chunk_seq``, a block of
    slots each. The last ``cdiv(N, BLOCK)``: ``seq_order``, a block of sequences each (ranked by
    length with ``RANK``, else in order)."""
    pid = tl.program_id(0)
    slot_programs = tl.cdiv(SLOTS, BLOCK)
    zero = tl.zeros([], dtype=tl.int64)
    if pid == 0:
        carry, chunk_carry, checkpoint_carry = zero, zero, zero
        tl.store(chunk_offsets, zero)
        tl.store(checkpoint_offsets, zero)
        for n0 in range(0, N, BLOCK):
            n, start, end, chunks = _sequences(cu_seqlens, n0, N, T, T_EACH, carry, VARLEN, BLOCK)
            ok = n < N
            tl.store(seq_offsets + n, start, mask=ok)
            tl.store(seq_offsets + n + 1, end, mask=ok)
            tl.store(chunk_offsets + n + 1, chunk_carry + tl.cumsum(chunks, 0), mask=ok)
            checkpoints = (chunks + CHECKPOINT - 1) // CHECKPOINT
            tl.store(checkpoint_offsets + n + 1, checkpoint_carry + tl.cumsum(checkpoints, 0), mask=ok)
            carry = tl.max(tl.where(ok, end, 0), 0)
            chunk_carry += tl.sum(chunks, 0)
            checkpoint_carry += tl.sum(checkpoints, 0)
    elif pid <= slot_programs:
        c = (pid - 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if VARLEN:
            # The sequence of slot c is the number of sequences whose chunks end at or before
            # it; sequence blocks past this block of slots are never read.
            first = (pid - 1).to(tl.int64) * BLOCK
            last = first + BLOCK - 1
            before = tl.zeros([BLOCK], dtype=tl.int64)
            carry, chunk_carry, n0 = zero, zero, 0
            while (n0 < N) & (chunk_carry <= last):
                n, start, end, chunks = _sequences(cu_seqlens, n0, N, T, T_EACH, carry, VARLEN, BLOCK)
                ends = chunk_carry + tl.cumsum(chunks, 0)
                if tl.max(tl.where(n < N, ends, 0), 0) <= first:  # the whole block ends before these slots
                    before += tl.sum((n < N).to(tl.int64), 0)
                else:
                    done = (ends[None, :] <= c[:, None]) & (n < N)[None, :]
                    before += tl.sum(done.to(tl.int64), 1)
                carry = tl.max(tl.where(n < N, end, 0), 0)
                chunk_carry += tl.sum(chunks, 0)
                n0 += BLOCK
            owner = before
        else:
            owner = c // tl.maximum((T_EACH + _ROWS - 1) // _ROWS, 1)
        tl.store(chunk_seq + c, tl.minimum(owner, N - 1), mask=c < SLOTS)
    else:
        m0 = (pid - 1 - slot_programs) * BLOCK
        if RANK:
            # The rank of sequence n: the longer sequences, and the equally long ones before it
            # (a stable sort, longest first).
            carry = zero
            for b0 in range(0, m0, BLOCK):
                _, _, end, _ = _sequences(cu_seqlens, b0, N, T, T_EACH, carry, VARLEN, BLOCK)
                carry = tl.max(tl.where(b0 + tl.arange(0, BLOCK) < N, end, 0), 0)
            m, start, end, _ = _sequences(cu_seqlens, m0, N, T, T_EACH, carry, VARLEN, BLOCK)
            length = end - start
            rank = tl.zeros([BLOCK], dtype=tl.int64)
            carry = zero
            for b0 in range(0, N, BLOCK):
                b, b_start, b_end, _ = _sequences(cu_seqlens, b0, N, T, T_EACH, carry, VARLEN, BLOCK)
                other = (b_end - b_start)[None, :]
                ahead = (other > length[:, None]) | ((other == length[:, None]) & (b[None, :] < m[:, None]))
                rank += tl.sum((ahead & (b < N)[None, :]).to(tl.int64), 1)
                carry = tl.max(tl.where(b < N, b_end, 0), 0)
        else:
            m = m0 + tl.arange(0, BLOCK)
            rank = m.to(tl.int64)
        for h in range(0, H):
            tl.store(seq_order + rank * H + h, m.to(tl.int64) * H + h, mask=m < N)


_BATCHED: dict[tuple, ChunkTables] = {}


def chunk_tables(p, capturing: bool | None = None) -> ChunkTables:
    """The tables of ``p`` (a checked Problem), built on its device by one launch on the current
    stream; batched layouts are kept per stream (:data:`BATCHED_CACHED`). ``capturing``: whether
    the current stream is being captured, if the caller knows (tables built in a capture live
    in its graph's pool, so they are not kept)."""
    varlen = p.cu_seqlens is not None
    key = None
    if not varlen:
        stream = torch.cuda.current_stream(p.q.device).cuda_stream if p.q.is_cuda else 0
        key = (p.q.device, stream, p.B, p.T, p.H, p.K)
        tables = _BATCHED.get(key)
        if tables is not None:
            return tables
    tables = build_tables(p)
    if key is not None and len(_BATCHED) < BATCHED_CACHED:
        if capturing is None:
            capturing = p.q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _BATCHED[key] = tables
    return tables


def build_tables(p) -> ChunkTables:
    """Launch :func:`build_tables_kernel` for ``p`` into one int64 tensor (on the CPU outside
    the interpreter, where no kernel can run: the same tables by torch, :func:`_host_tables`)."""
    varlen = p.cu_seqlens is not None
    N = p.N
    slots = chunk_slots(p.B, p.T, N, varlen)
    packed = torch.empty(3 * (N + 1) + slots + N * p.H, dtype=torch.int64, device=p.q.device)
    seq_offsets, chunk_offsets, checkpoint_offsets = packed[: 3 * (N + 1)].view(3, N + 1).unbind()
    chunk_seq = packed[3 * (N + 1) : 3 * (N + 1) + slots]
    seq_order = packed[3 * (N + 1) + slots :]
    if N and p.q.is_cpu and not _interpreting():
        _host_tables(p, seq_offsets, chunk_offsets, chunk_seq, seq_order, checkpoint_offsets)
    elif N:
        build_tables_kernel[(1 + cdiv(slots, BLOCK) + cdiv(N, BLOCK),)](
            p.cu_seqlens if varlen else packed, seq_offsets, chunk_offsets, chunk_seq, seq_order, checkpoint_offsets,
            N, p.T, 0 if varlen else p.T, p.H, slots,
            VARLEN=varlen, RANK=varlen and N <= ORDER_MAX, CHECKPOINT=CHECKPOINT_CHUNKS, BLOCK=BLOCK,
        )  # fmt: skip
    else:
        packed[: 3 * (N + 1)].zero_()
    return ChunkTables(
        seq_offsets=seq_offsets,
        chunk_offsets=chunk_offsets,
        chunk_seq=chunk_seq,
        seq_order=seq_order,
        checkpoint_offsets=checkpoint_offsets,
        num_chunks=slots,
        BK=max(next_power_of_2(p.K), DOT_MIN),
    )


def _interpreting() -> bool:
    from kda.triton.common import interpreting

    return interpreting()


def _host_tables(p, seq_offsets, chunk_offsets, chunk_seq, seq_order, checkpoint_offsets) -> None:
    """:func:`build_tables_kernel`'s tables by torch ops, for CPU tensors outside the
    interpreter (tests that fake the CUDA launch on the CPU)."""
    N = p.N
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
