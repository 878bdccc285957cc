"""The chunk tables (kda.tables), built on the device from ``cu_seqlens``: against a model of
them, under any offsets, and the serving contract they make possible (spec section 7): a
varlen prefill with new lengths every call makes no host synchronisation, replays in a CUDA
graph with new lengths, and is safe from several threads at once."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda
from helpers import AUTO, DEVICE, cuda_ready, make_case
from kda import abi, tables, validation
from kda.api import checked_problem
from kda.tables import CHECKPOINT_CHUNKS, CHUNK, build_tables, chunk_slots, chunk_tables
from kda.triton.tables import BLOCK


def model(lengths: list[int], H: int) -> dict[str, list[int]]:
    """The tables of sequences of ``lengths``, by plain Python."""
    seq, chunk, checkpoint = [0], [0], [0]
    for n in lengths:
        chunks = -(-n // CHUNK)
        seq.append(seq[-1] + n)
        chunk.append(chunk[-1] + chunks)
        checkpoint.append(checkpoint[-1] + -(-chunks // CHECKPOINT_CHUNKS))
    owners = [n for n in range(len(lengths)) for _ in range(chunk[n + 1] - chunk[n])]
    longest_first = sorted(range(len(lengths)), key=lambda n: -lengths[n])  # stable
    return dict(seq_offsets=seq, chunk_offsets=chunk, checkpoint_offsets=checkpoint, chunk_seq=owners,
                seq_order=[n * H + h for n in longest_first for h in range(H)])  # fmt: skip


def problem(cu: torch.Tensor | None, B: int, T: int, H: int) -> SimpleNamespace:
    """What build_tables reads of a checked call."""
    N = B if cu is None else cu.numel() - 1
    return SimpleNamespace(cu_seqlens=cu, N=N, B=B, T=T, H=H, K=32, q=torch.empty(1, device=DEVICE))


def check_against_model(t, lengths: list[int], H: int) -> None:
    want = model(lengths, H)
    for name in ("seq_offsets", "chunk_offsets", "checkpoint_offsets", "seq_order"):
        assert getattr(t, name).tolist() == want[name], name
    real = len(want["chunk_seq"])
    owners = t.chunk_seq.tolist()
    assert owners[:real] == want["chunk_seq"]
    # Slots past the real chunks belong to the last sequence, and start past its end.
    assert owners[real:] == [len(lengths) - 1] * (t.num_chunks - real)


@given(
    lengths=st.lists(st.sampled_from([0, 1, 15, 16, 17, 33, 100, 257]), min_size=1, max_size=2 * BLOCK + 3),
    H=st.sampled_from([1, 3]),
)
def test_varlen_tables_match_a_model_of_them(lengths, H):
    """Empty, one-token and partial-chunk sequences, sequence counts across the builder's
    blocks (64), ties in length (the order is a stable sort, longest first)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    t = build_tables(problem(cu, 1, sum(lengths), H))
    assert t.num_chunks == chunk_slots(1, sum(lengths), len(lengths), True)
    check_against_model(t, lengths, H)


@pytest.mark.parametrize("N", [63, 64, 65, 128, 129])
def test_varlen_tables_at_the_builders_block_edges(N):
    """Sequence counts at the edges of the builder's blocks of 64 (hypothesis may not draw them)."""
    gen = torch.Generator().manual_seed(N)
    lengths = torch.randint(0, 40, (N,), generator=gen).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    check_against_model(build_tables(problem(cu, 1, sum(lengths), 2)), lengths, 2)


@pytest.mark.parametrize("B, T", [(1, 1), (3, 17), (2, 0), (5, 64), (70, 5)])
def test_batched_tables_match_a_model_of_them(B, T):
    t = build_tables(problem(None, B, T, 2))
    assert t.num_chunks == chunk_slots(B, T, B, False) == B * -(-T // CHUNK)
    check_against_model(t, [T] * B, 2)


def test_longest_first_order_gives_way_to_the_given_order_past_its_limit(monkeypatch):
    """Ranking is quadratic in the sequences: past ORDER_MAX they are taken as they come."""
    monkeypatch.setattr(tables, "ORDER_MAX", 2)
    cu = torch.tensor([0, 1, 5, 25], device=DEVICE)
    assert build_tables(problem(cu, 1, 25, 1)).seq_order.tolist() == [0, 1, 2]
    monkeypatch.setattr(tables, "ORDER_MAX", 3)
    assert build_tables(problem(cu, 1, 25, 1)).seq_order.tolist() == [2, 1, 0]


ANY_OFFSETS = [[5, -3, 100, 40, 1000], [0, 50, 10, 50], [-7, -7, -1], [0, 2**40, 3], [0, 13, 13, 2, 50]]


@pytest.mark.parametrize("offsets", ANY_OFFSETS)
def test_any_offsets_give_tables_inside_the_call(offsets):
    """Whatever a graph replay or an unchecked call puts in ``cu_seqlens``, the tables the
    kernels walk stay inside the T tokens and the chunk slots: offsets clamped into [0, T]
    and non-decreasing, every chunk range inside the slots, every owner a sequence."""
    T = 50
    cu = torch.tensor(offsets, device=DEVICE)
    N = len(offsets) - 1
    t = build_tables(problem(cu, 1, T, 2))
    seq = t.seq_offsets.tolist()
    assert all(0 <= a <= b <= T for a, b in zip(seq, seq[1:]))
    chunk = t.chunk_offsets.tolist()
    assert chunk[0] == 0 and all(a <= b for a, b in zip(chunk, chunk[1:])) and chunk[-1] <= t.num_chunks
    assert all(b - a == -(-(y - x) // CHUNK) for a, b, x, y in zip(chunk, chunk[1:], seq, seq[1:]))
    assert all(0 <= n < N for n in t.chunk_seq.tolist())
    # Every slot's first token: inside its owner for the real chunks, past its end for the rest.
    for c, n in enumerate(t.chunk_seq.tolist()):
        t0 = seq[n] + (c - chunk[n]) * CHUNK
        assert (seq[n] <= t0 < seq[n + 1]) if c < chunk[-1] else t0 >= seq[n + 1], (c, n, t0)
    assert sorted(t.seq_order.tolist()) == list(range(N * 2))


@pytest.mark.parametrize(
    "cu, B, T",
    [([0, 16, 16, 57, 300], 1, 300), (list(range(0, 131)), 1, 130), (None, 3, 17)]
    + [(offsets, 1, 50) for offsets in ANY_OFFSETS],
)
def test_host_tables_equal_the_kernels(cu, B, T, monkeypatch):
    """CPU tensors outside the interpreter (the fake-launch tests on a GPU machine) get the
    tables from torch ops: the same as the kernel's, bit for bit, for any offsets."""
    cu_dev = None if cu is None else torch.tensor(cu, device=DEVICE)
    want = build_tables(problem(cu_dev, B, T, 2))
    monkeypatch.setattr(tables, "_interpreting", lambda: False)
    host = problem(None if cu is None else torch.tensor(cu), B, T, 2)
    host.q = torch.empty(1)
    got = build_tables(host)
    for name in ("seq_offsets", "chunk_offsets", "chunk_seq", "seq_order", "checkpoint_offsets"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


TABLES = ("seq_offsets", "chunk_offsets", "chunk_seq", "seq_order", "checkpoint_offsets")


def assert_builders_agree(cu: list[int] | None, B: int, T: int, H: int, dtype=torch.int64) -> None:
    """The CUDA path's kda_build_tables (prepare.cu), the Triton kernel and the host's torch ops
    write the same tables, bit for bit; the CUDA kernel writes every entry (a second build into
    poisoned tables)."""
    from kda.cuda import loader

    assert not tables._interpreting()
    cu_dev = None if cu is None else torch.tensor(cu, dtype=dtype, device="cuda")
    p = problem(cu_dev, B, T, H)
    kernels = loader.kernels()
    stream = torch.cuda.current_stream().cuda_stream
    cuda = build_tables(p, kernels, stream)
    for name in TABLES:
        getattr(cuda, name).fill_(-7)
    tables._launch_cuda_builder(p, cuda, cu is not None and p.N <= tables.ORDER_MAX, kernels, stream)
    triton = build_tables(p)
    host = problem(None if cu is None else torch.tensor(cu, dtype=dtype), B, T, H)
    host.q = torch.empty(1)
    host = build_tables(host)
    assert cuda.num_chunks == triton.num_chunks == host.num_chunks
    for name in TABLES:
        got = getattr(cuda, name).cpu()
        assert torch.equal(got, getattr(triton, name).cpu()), (name, "triton")
        assert torch.equal(got, getattr(host, name)), (name, "host")


@st.composite
def cu_seqlens_layouts(draw) -> tuple[list[int], int]:
    """``(cu_seqlens, T)``: packed lengths (empty, one-token, partial and whole chunks; enough
    chunks to cross the CUDA builder's slot blocks of abi.TABLES_SLOTS), or any offsets at all
    (decreasing, negative, past T)."""
    if draw(st.booleans()):
        lengths = draw(st.lists(st.sampled_from([0, 1, 15, 16, 17, 33, 257, 4000]), min_size=1, max_size=140))
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        return cu, cu[-1]
    T = draw(st.integers(0, 300))
    return draw(st.lists(st.integers(-40, 2 * T + 40), min_size=2, max_size=140)), T


@pytest.mark.gpu
@cuda_ready
@given(case=cu_seqlens_layouts(), H=st.sampled_from([1, 3]), int32=st.booleans())
def test_gpu_cuda_builder_equals_the_triton_and_host_tables(case, H, int32):
    cu, T = case
    assert_builders_agree(cu, 1, T, H, torch.int32 if int32 else torch.int64)


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("N", [2047, 2049, abi.ORDER_MAX, abi.ORDER_MAX + 1, 2 * 2048 + 5])
def test_gpu_cuda_builder_across_its_tiles_and_the_order_limit(N):
    """Sequence counts across the CUDA builder's tiles of 2048 (its walks carry offsets and chunk
    counts from tile to tile) and at ORDER_MAX, past which both builders leave the order as given."""
    gen = torch.Generator().manual_seed(N)
    lengths = torch.randint(0, 40, (N,), generator=gen)
    lengths[torch.randint(0, N, (N // 4,), generator=gen)] = 0
    cu = [0, *lengths.cumsum(0).tolist()]
    assert_builders_agree(cu, 1, cu[-1], 2)


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("N", [2048, 4095, 4097])
@pytest.mark.parametrize("int32", [False, True])
def test_gpu_cuda_builder_carries_the_running_max_across_tiles(N, int32):
    """Offsets that climb past T in the first tile of 2048 sequences and then fall, go negative
    and rise again: the clamp and the running max must carry from tile to tile (each walk's scan
    starts from the previous tile's largest offset; N = 4095 and 4097 cross into a second tile,
    N = 2048 is one full tile whose last offset closes the walk), for int32 and int64 cu_seqlens,
    H = 32 (the head loop of the order's writes goes round more than once). A helper's review,
    2026-12-04."""
    gen = torch.Generator().manual_seed(N + int32)
    T = 3000
    cu = torch.randint(-50, T + 200, (N + 1,), generator=gen)
    cu[:1500] = torch.arange(1500) * 3  # rising through the first tile
    cu[1500] = T + 100  # past T: clamped to T, and the running max holds it there
    below = cu[1501:2100]  # (548 entries at N = 2048: the slice ends with the offsets)
    below.copy_(torch.randint(-100, 200, below.shape, generator=gen))  # below the running max: read as T
    assert_builders_agree(cu.tolist(), 1, T, 32, torch.int32 if int32 else torch.int64)


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("B, T", [(1, 1), (3, 17), (2, 0), (5, 64), (70, 5), (2, 40000)])
def test_gpu_cuda_builder_batched(B, T):
    assert_builders_agree(None, B, T, 2)


def test_batched_tables_are_kept_varlen_ones_built_per_call():
    """Batched tables depend on the shapes alone and are kept; varlen ones are built from
    ``cu_seqlens`` on every call (its values may change between calls, or graph replays)."""
    a = make_case(B=2, T=20, H=1, K=16, V=16, device=DEVICE, seed=1)
    pa = checked_problem(kda.chunk_kda, *a.tensors(), **a.kwargs())
    assert chunk_tables(pa) is chunk_tables(pa)
    b = make_case(seq_lens=[5, 20], H=1, K=16, V=16, device=DEVICE, seed=2)
    pb = checked_problem(kda.chunk_kda, *b.tensors(), **b.kwargs())
    assert chunk_tables(pb) is not chunk_tables(pb)
    assert chunk_tables(pb).chunk_offsets.tolist() == [0, 1, 3]


def test_kept_batched_tables_are_per_head_count(monkeypatch):
    """Two batched calls that differ in their head count only get their own tables: seq_order
    lists every (sequence, head) pair, so one kept for H = 2 would send K2 past its end at H = 4
    (a mutation audit of 2026-12-05 found H left out of the cache key passing)."""
    monkeypatch.setattr(tables, "_BATCHED", {})
    for H in (2, 4, 2):
        check_against_model(chunk_tables(problem(None, 2, 40, H)), [40, 40], H)


def test_batched_tables_are_kept_up_to_their_limit(monkeypatch):
    """BATCHED_CACHED shapes are kept; past it, tables are built per call and nothing is evicted."""
    monkeypatch.setattr(tables, "_BATCHED", {})
    monkeypatch.setattr(tables, "BATCHED_CACHED", 1)
    a, b = (problem(None, B, 20, 1) for B in (2, 3))
    kept = chunk_tables(a)
    assert chunk_tables(a) is kept
    assert chunk_tables(b) is not chunk_tables(b)
    assert list(tables._BATCHED.values()) == [kept]


@pytest.mark.gpu
def test_gpu_batched_tables_are_kept_per_stream(monkeypatch):
    """A batched table is built on the stream of its first call; another stream gets its own
    (it could otherwise run before the build did), a capture keeps none."""
    monkeypatch.setattr(tables, "_BATCHED", {})
    p = problem(None, 4, 33, 2)
    here = chunk_tables(p)
    assert chunk_tables(p) is here
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        there = chunk_tables(p)
        assert there is not here and chunk_tables(p) is there
    torch.cuda.synchronize()
    assert there.chunk_seq.tolist() == here.chunk_seq.tolist()
    kept = dict(tables._BATCHED)
    graph, new = torch.cuda.CUDAGraph(), problem(None, 5, 33, 2)
    with torch.cuda.graph(graph):  # (the kernel compiled above: 5 and 4 specialise alike)
        chunk_tables(new)
    assert kept == tables._BATCHED


def test_varlen_values_are_checked_once_on_the_host_unless_told_not_to(monkeypatch):
    """By default a varlen call checks its offsets on the host (from ``cu_seqlens_cpu``, or one
    copy); KDA_CHECK_CU_SEQLENS=0 leaves a device ``cu_seqlens`` unchecked (no copy): the
    problem then has no host lengths, and the routes that need them take the bound T."""
    case = make_case(seq_lens=[7, 30], H=1, K=16, V=16, seed=3)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert p.cu_seqlens_values == (0, 7, 37) and p.longest == 30
    if DEVICE == "cuda":
        cu = case.cu_seqlens.cuda()
        monkeypatch.setattr(validation, "CHECK_CU_SEQLENS", "0")
        c = case.to(case.q.dtype, "cuda")
        p = checked_problem(kda.chunk_kda, *c.tensors(), **c.kwargs(cu_seqlens=cu))
        assert p.cu_seqlens_cpu is None and p.cu_seqlens_values is None and p.longest == 37 and p.N == 2


def _threaded_calls(backend: str, threads: int = 4, calls: int = 3) -> None:
    """Several threads, each with its own layouts, call kda at once; every result must equal
    the same call made alone. (The CUDA kernels take bf16 and head size 128.)"""
    shape = dict(K=128, V=128, dtype=torch.bfloat16) if backend == "cuda" else dict(K=16, V=16)
    cases = [[make_case(seq_lens=[3 + 5 * i + j, 40 - 7 * j, 16], H=2, device=DEVICE, seed=10 * i + j, **shape)
              for j in range(calls)] for i in range(threads)]  # fmt: skip
    alone = [[kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs()) for c in row] for row in cases]
    got: dict[int, list] = {}
    start = threading.Barrier(threads)

    def run(i):
        start.wait()
        got[i] = [kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs()) for c in cases[i]]

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for i in range(threads):
        for (o, ht), (o1, ht1) in zip(got[i], alone[i]):
            assert torch.equal(o, o1) and torch.equal(ht, ht1), f"thread {i}"


def test_calls_from_several_threads_equal_the_calls_alone():
    """On the CPU the torch backend (the Triton interpreter swaps module attributes while it
    runs, so it is single-threaded); on a GPU the chunk kernels, below."""
    _threaded_calls("torch" if DEVICE == "cpu" else AUTO)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=cuda_ready)])
def test_gpu_calls_from_several_threads_equal_the_calls_alone(backend):
    _threaded_calls(backend)


def _prefill_case(lengths, seed, dtype=torch.bfloat16):
    # K = V = 128: the CUDA path's head size
    return make_case(seq_lens=lengths, H=2, K=128, V=128, dtype=dtype, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=cuda_ready)])
@pytest.mark.parametrize("host_copy", [True, False])
def test_gpu_varlen_prefill_makes_no_host_sync(backend, host_copy, monkeypatch):
    """A varlen prefill with new lengths every call, under torch's sync debug mode set to
    error: with ``cu_seqlens_cpu``, or without it and KDA_CHECK_CU_SEQLENS=0. Each call's
    output is then checked against the same call made with syncs allowed."""
    if not host_copy:
        monkeypatch.setattr(validation, "CHECK_CU_SEQLENS", "0")
    cases = [_prefill_case(lens, seed=i) for i, lens in enumerate(([100, 7, 300], [1, 250, 33, 0, 64], [513]))]
    for c in cases:  # warm up: compile every kernel first (compiling may sync)
        kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs(cu_seqlens_cpu=c.cu_seqlens.cpu()))
    results = []
    hosts = [{"cu_seqlens_cpu": c.cu_seqlens.cpu()} if host_copy else {} for c in cases]  # copied before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for c, host in zip(cases, hosts):
            results.append(kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs(**host)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for c, (o, ht) in zip(cases, results):
        o1, ht1 = kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs())
        assert torch.equal(o, o1) and torch.equal(ht, ht1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=cuda_ready)])
def test_gpu_varlen_prefill_replays_in_a_cuda_graph_with_new_lengths(backend):
    """Captured once (no ``cu_seqlens_cpu``: a capture checks nothing on the host), replayed with
    new lengths and new inputs copied into the captured buffers: each replay equals an eager
    call on the same inputs. The sequence count and the total tokens stay (they are shapes)."""
    layouts = ([60, 4, 0, 200], [1, 1, 1, 261], [131, 0, 133, 0], [0, 0, 0, 264])
    cases = [_prefill_case(lens, seed=20 + i) for i, lens in enumerate(layouts)]
    first = cases[0]
    buffers = [x.clone() for x in first.tensors()]
    # every tensor the call reads is a captured buffer, refilled before each replay
    held = {n: getattr(first, n).clone() for n in ("initial_state", "A_log", "dt_bias", "cu_seqlens")}
    kw = first.kwargs(**held)

    def call():
        return kda.chunk_kda(*buffers, backend=backend, **kw)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = call()
    for c in cases[1:] + cases[:1]:
        for buf, x in zip(buffers, c.tensors()):
            buf.copy_(x)
        for n, buf in held.items():
            buf.copy_(getattr(c, n))
        graph.replay()
        o_eager, ht_eager = kda.chunk_kda(*c.tensors(), backend=backend, **c.kwargs())
        assert torch.equal(o, o_eager) and torch.equal(ht, ht_eager), c.cu_seqlens.tolist()


def test_host_integer_helpers_match_tritons():
    """kda.intmath stands in for triton.cdiv and triton.next_power_of_2 on the host (theirs cost
    microseconds a call): the same values wherever kda calls them (sizes >= 1)."""
    import triton

    from kda.intmath import cdiv, next_power_of_2

    for n in [*range(1, 300), 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
