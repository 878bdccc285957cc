"""The chunk tables' Triton builder (kda.tables lays the tables out, says what each holds and
chooses the builder): the Triton backend's, and the fallback wherever the CUDA path's
``kda_build_tables`` (prepare.cu) is not loaded. Imported by kda.tables at its first launch, so
the CUDA path never imports Triton for its tables."""

from __future__ import annotations

import triton
import triton.language as tl

from kda.intmath import cdiv
from kda.tables import CHECKPOINT_CHUNKS, CHUNK

_ROWS = tl.constexpr(CHUNK)  # tokens per chunk, as the kernel may read it
# Sequences and chunk slots per program of the builder (its matrices are BLOCK x BLOCK).
BLOCK = 64


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


def launch_build_tables(p, tables, rank: bool) -> None:
    """Launch :func:`build_tables_kernel` for ``p`` (a checked Problem) into ``tables``
    (kda.tables.ChunkTables), on the current device's current stream; ``rank``: seq_order
    longest sequence first."""
    varlen = p.cu_seqlens is not None
    N, slots = p.N, tables.num_chunks
    build_tables_kernel[(1 + cdiv(slots, BLOCK) + cdiv(N, BLOCK),)](
        p.cu_seqlens if varlen else tables.seq_offsets, tables.seq_offsets, tables.chunk_offsets, tables.chunk_seq,
        tables.seq_order, tables.checkpoint_offsets,
        N, p.T, 0 if varlen else p.T, p.H, slots,
        VARLEN=varlen, RANK=rank, CHECKPOINT=CHECKPOINT_CHUNKS, BLOCK=BLOCK,
    )  # fmt: skip
