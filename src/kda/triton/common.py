"""Pieces the Triton stages share: the chunk size, autotune configs, the chunk tables and the
training forward's state checkpoints."""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda import abi
from kda.validation import SAFE_LOWER_BOUND_MIN

CHUNK = abi.CHUNK  # tokens per chunk, the CUDA kernels' too
DOT_MIN = 16  # tl.dot's smallest M, N and K: a block that feeds a dot is at least this wide
# The training forward saves the state entering every CHECKPOINT_CHUNKS-th chunk of each
# sequence (float32, [rows, HV, V, K]); the backward recomputes the states in between, each
# chunk from its own checkpoint (at most CHECKPOINT_CHUNKS - 1 chunk steps). Four chunks
# (64 tokens, fla's chunk) keep a quarter of the per-chunk states between forward and
# backward. docs/algorithm.md section 8 has the account.
CHECKPOINT_CHUNKS = 4


def checkpoint_rows(B: int, T: int, N: int, varlen: bool) -> int:
    """Rows of the checkpoint tensor, from the shapes alone (the fake of the training op must
    know it without the sequence lengths): exact for B sequences of T tokens; for N packed
    sequences an upper bound, as sum_n ceil(L_n / 64) <= ceil(T / 64) + N."""
    span = CHUNK * CHECKPOINT_CHUNKS
    if not varlen:
        return B * -(-T // span)
    return -(-T // span) + N


def safe_gate_path(p) -> bool:
    """Whether the kernels may compile out the far-row and reset paths: the lower-bound gate
    with ``lb >= validation.SAFE_LOWER_BOUND_MIN`` keeps every 16-token decay inside
    ``prepare.EXP2_LIMIT`` (``16 * 5 / ln 2 < 116``) and never resets."""
    return p.gate_form == "lower_bound" and p.lower_bound >= SAFE_LOWER_BOUND_MIN


# Read once, when this module (and so every kernel of kda.triton) is defined: triton.jit takes
# its mode from TRITON_INTERPRET at definition, so a later change of the variable (a test
# setting it for child processes, seen 2026-12-01 on the H200) changes nothing here either.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when kda's kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU
    tensors through numpy)."""
    return _INTERPRETING


@triton.jit
def _loop_bound_probe(offsets, out):
    total = 0
    for i in tl.range(tl.load(offsets), tl.load(offsets + 1)):
        total += i
    tl.store(out, total)


@functools.cache
def interpreter_fault() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None. Seen 2026-12-01: Triton
    3.6.0's interpreter with NumPy 2.4 fails on every loop whose bounds are loaded from memory
    (it calls int() on a one-element array, which NumPy 2.4 refuses); NumPy 2.3 or Triton 3.9
    run it. Probed once with a loop of that form rather than by version numbers."""
    offsets, out = torch.tensor([2, 5]), torch.zeros(1, dtype=torch.int64)
    try:
        _loop_bound_probe[(1,)](offsets, out)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the answer
        import numpy

        return (f"Triton {triton.__version__}'s interpreter fails with NumPy {numpy.__version__} on loop bounds "
                f"loaded from memory ({type(e).__name__}); install numpy<2.4 or a newer Triton")  # fmt: skip
    return None if int(out) == 9 else f"Triton {triton.__version__}'s interpreter miscounts a loop (got {int(out)})"


def autotune_configs(params: list[dict], warps: tuple[int, ...], stages: tuple[int, ...]) -> list[triton.Config]:
    """Every combination of ``params`` x warps x stages. Only the first (the first listed
    value of each) under the interpreter, which cannot time kernels, or with
    ``KDA_TRITON_AUTOTUNE=0`` (test runs that would otherwise tune dozens of shapes). A
    ``maxnreg`` key of a params dict caps ptxas' registers per thread for that config."""
    combos = list(itertools.product(params, warps, stages))
    if interpreting() or os.environ.get("KDA_TRITON_AUTOTUNE", "1") == "0":
        combos = combos[:1]
    configs = []
    for kw, nw, ns in combos:
        kw = dict(kw)
        maxnreg = kw.pop("maxnreg", None)
        configs.append(triton.Config(kw, num_warps=nw, num_stages=ns, maxnreg=maxnreg))
    return configs


@dataclass
class ChunkTables:
    """Where every chunk lives. Batched inputs are treated as N = B packed sequences.

    ``seq_offsets [N+1]``: token offsets; ``chunk_offsets [N+1]``: first global chunk of
    each sequence; ``chunk_seq [NC]``: sequence of each chunk; ``seq_order [N*H]``: the
    (sequence, head) pairs as ``n * H + h``, longest sequence first (the CUDA recurrence's
    schedule: the longest chains start first, short ones fill in behind);
    ``checkpoint_offsets [N+1]``: first checkpoint row of each sequence (training). All int64.
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


TABLES_CACHED = 64
_TABLES: OrderedDict[tuple, ChunkTables] = OrderedDict()
# Tables a CUDA graph has captured: the graph replays their addresses, so they are never freed.
_CAPTURED: dict[tuple, ChunkTables] = {}
# The layout asked for last and its tables (the most recent entry of _TABLES): a call repeating
# it compares one key instead of hashing it twice into the LRU (0.3 us against 0.9).
_last: tuple[tuple | None, ChunkTables | None] = (None, None)
_lock = threading.Lock()


def chunk_tables(p, capturing: bool | None = None) -> ChunkTables:
    """The tables of ``p``, built once per layout (device, shape, sequence lengths) and kept
    in a small LRU cache: a repeated call then moves nothing from the host (less host time,
    and the call can be captured in a CUDA graph once it has run eagerly). ``capturing``:
    whether the current stream is being captured, if the caller knows (else asked here).

    Kernels on any stream, and captured graphs, keep reading the tables after the call
    returns, so: the copy to the device completes before first use (a blocking copy); a
    layout used during a capture is kept for good; and the LRU drops an entry only after a
    device synchronize (never during a capture), so no queued kernel still reads it."""
    global _last
    key = (p.q.get_device(), p.B, p.T, p.H, p.K, p.cu_seqlens_values)  # device: -1 for CPU tensors
    if capturing is None:
        capturing = p.q.is_cuda and torch.cuda.is_current_stream_capturing()
    last_key, tables = _last
    if key == last_key and not capturing:
        return tables
    with _lock:  # get, move_to_end and eviction from several threads
        tables = _TABLES.get(key)
        if tables is None:
            tables = _CAPTURED.get(key)
            if tables is None:
                tables = _TABLES[key] = _build_chunk_tables(p)
                if len(_TABLES) > TABLES_CACHED and not capturing:
                    evicted_key, evicted = _TABLES.popitem(last=False)
                    if evicted_key[0] >= 0:  # its kernels may be queued on any stream of its device
                        torch.cuda.synchronize(evicted_key[0])
                    del evicted
        else:
            _TABLES.move_to_end(key)
        if capturing:
            _CAPTURED[key] = tables
        _last = (key, tables)
    return tables


def _build_chunk_tables(p) -> ChunkTables:
    """Build the tables on the host from host offsets (validation keeps a CPU copy of
    ``cu_seqlens``, so this costs no device sync) and copy them in one transfer."""
    offsets = torch.arange(p.B + 1, dtype=torch.int64) * p.T if p.cu_seqlens is None else p.cu_seqlens_cpu
    lengths = offsets[1:] - offsets[:-1]
    counts = (lengths + CHUNK - 1) // CHUNK
    chunk_offsets = torch.zeros_like(offsets)
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    num_chunks = int(chunk_offsets[-1])
    N = len(counts)
    chunk_seq = torch.repeat_interleave(torch.arange(N, dtype=torch.int64), counts)
    longest = torch.argsort(lengths, descending=True, stable=True)
    seq_order = (longest[:, None] * p.H + torch.arange(p.H)[None, :]).reshape(-1)
    checkpoint_offsets = torch.zeros_like(offsets)
    torch.cumsum((counts + CHECKPOINT_CHUNKS - 1) // CHECKPOINT_CHUNKS, 0, out=checkpoint_offsets[1:])
    packed = torch.cat([offsets, chunk_offsets, chunk_seq, seq_order, checkpoint_offsets])
    packed = packed.to(p.q.device)  # blocking: see chunk_tables
    order_end = 2 * N + 2 + num_chunks + N * p.H
    return ChunkTables(
        seq_offsets=packed[: N + 1],
        chunk_offsets=packed[N + 1 : 2 * N + 2],
        chunk_seq=packed[2 * N + 2 : 2 * N + 2 + num_chunks],
        seq_order=packed[2 * N + 2 + num_chunks : order_end],
        checkpoint_offsets=packed[order_end:],
        num_chunks=num_chunks,
        BK=max(triton.next_power_of_2(p.K), DOT_MIN),
    )
