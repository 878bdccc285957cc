"""Context parallelism over torch.distributed (kda.context_parallel): ranks holding contiguous
slices of the tokens give the unsharded call's outputs on their tokens and its final state.
CPU: gloo, spawned processes, the torch backend and Triton under the interpreter."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda
from helpers import make_case, rel

T_LOCAL = 20  # not a multiple of 16: rank boundaries fall inside the unsharded call's chunks


def exits_without_teardown(worker):
    """A spawned worker that, once it has passed and destroyed its process group, leaves with
    os._exit(0) instead of the interpreter's teardown. Seen once, 2026-12-01, in CI (2 cores,
    a 3-rank gradient run): one worker died with SIGABRT ("terminate called without an active
    exception", no Python error) while the others still ran; six runs of that test alone
    passed. The likeliest cause is a gloo thread destroyed at exit (pytorch/pytorch#179291
    describes gloo's worker threads crashing interpreter finalization); if the crash was
    mid-run instead, this does not cure it. A failure still raises first, and spawn reports it."""

    @functools.wraps(worker)
    def run(*args):
        worker(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def gentle_decays(case) -> None:
    """The softplus and lower-bound gates' raw inputs lowered to decays of about 0.01 a token, so
    that a rank's entering state (P of the ranks before it) shows in its outputs: the default
    gates forget it within a slice (a review, 2026-12-05: a wrong P passed those cases)."""
    case.g = case.g * 0.1 - 8


@exits_without_teardown
def _worker(rank, world, store, backend, layout, with_h0, mismatch, deprecated=False, gentle=False):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        case = make_case(B=2, T=world * T_LOCAL, H=1, HV=2, K=16, V=8, gate="softplus", state_v_first=layout,
                         with_state=with_h0, seed=71)  # fmt: skip
        if gentle:
            gentle_decays(case)
        kw = case.kwargs()
        if deprecated:  # fla's old name for the V-first layout: the ranks must read it as state_v_first
            kw["transpose_state_layout"] = kw.pop("state_v_first")
        o_all, ht_all = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
        span = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL - (1 if mismatch and rank == 1 else 0))
        local = [x[:, span].contiguous() for x in case.tensors()]
        if mismatch:
            with pytest.raises(ValueError, match="differ in shape"):
                kda.chunk_kda(*local, backend=backend, cp_group=dist.group.WORLD, **kw)
            return
        o, ht = kda.chunk_kda(*local, backend=backend, cp_group=dist.group.WORLD, **kw)
        assert rel(o, o_all[:, span]) <= 1e-5, (rank, rel(o, o_all[:, span]))
        assert rel(ht, ht_all) <= 1e-5, (rank, rel(ht, ht_all))
    finally:
        dist.destroy_process_group()


@exits_without_teardown
def _grad_worker(rank, world, store, backend, layout, with_h0, only_h0=False, KV=(16, 8), gentle=False):
    """Each rank's loss: its outputs against fixed weights, and (last rank) the final state's.
    Summed over ranks it is the unsharded call's loss, so every gradient must match: the local
    slices of q, k, v, g, beta, the first rank's initial state, and A_log, dt_bias summed
    over ranks."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        case = make_case(B=2, T=world * T_LOCAL, H=1, HV=2, K=KV[0], V=KV[1], gate="softplus", state_v_first=layout,
                         with_state=with_h0, seed=73)  # fmt: skip
        if gentle:
            gentle_decays(case)
        gen = torch.Generator().manual_seed(74)
        w_o = torch.randn(case.v.shape, generator=gen)
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias") + (("initial_state",) if with_h0 else ())

        def leaves(c, span=slice(None)):
            out = {n: getattr(c, n).detach().clone() for n in names}
            for n in ("q", "k", "v", "g", "beta"):
                out[n] = out[n][:, span].contiguous()
            return {n: x.requires_grad_(not only_h0 or n == "initial_state") for n, x in out.items()}

        def call(t, **over):
            kw = case.kwargs(**{n: t[n] for n in ("A_log", "dt_bias")}, **over)
            if with_h0:
                kw["initial_state"] = t["initial_state"]
            return kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], backend=backend, **kw)

        full = leaves(case)
        o_all, ht_all = call(full)
        w_h = torch.randn(ht_all.shape, generator=gen)
        ((o_all * w_o).sum() + (ht_all * w_h).sum()).backward()

        span = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
        mine = leaves(case, span)
        o, ht = call(mine, cp_group=dist.group.WORLD)
        loss = (o * w_o[:, span]).sum() + ((ht * w_h).sum() if rank == world - 1 else 0.0)
        loss.backward()
        if only_h0:  # the other ranks' outputs depend on it through the gathered start
            if rank == 0:
                assert rel(mine["initial_state"].grad, full["initial_state"].grad) <= 1e-4
            return
        for n in ("q", "k", "v", "g", "beta"):
            assert rel(mine[n].grad, full[n].grad[:, span]) <= 1e-4, (rank, n, rel(mine[n].grad, full[n].grad[:, span]))
        for n in ("A_log", "dt_bias"):
            total = mine[n].grad.clone()
            dist.all_reduce(total)
            assert rel(total, full[n].grad) <= 1e-4, (rank, n, rel(total, full[n].grad))
        if with_h0 and rank == 0:
            assert rel(mine["initial_state"].grad, full["initial_state"].grad) <= 1e-4
    finally:
        dist.destroy_process_group()


@exits_without_teardown
def _packed_worker(rank, world, store, backend, layout, with_h0, lens, slices, train, KV=(16, 8), gentle=False):
    """Packed sequences ``lens`` cut into rank slices of ``slices`` tokens: outputs and final
    states against the unsharded packed call, and with ``train`` every gradient too (each
    rank's loss: its outputs, and the final states of the sequences ending on the last rank)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        case = make_case(seq_lens=lens, H=1, HV=2, K=KV[0], V=KV[1], gate="lower_bound", state_v_first=layout,
                         with_state=with_h0, seed=75)  # fmt: skip
        if gentle:
            gentle_decays(case)
        gen = torch.Generator().manual_seed(76)
        w_o = torch.randn(case.v.shape, generator=gen)
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias") + (("initial_state",) if with_h0 else ())
        lo = sum(slices[:rank])
        span = slice(lo, lo + slices[rank])

        def leaves(sl=slice(None)):
            out = {n: getattr(case, n).detach().clone() for n in names}
            for n in ("q", "k", "v", "g", "beta"):
                out[n] = out[n][:, sl].contiguous()
            return {n: x.requires_grad_(train) for n, x in out.items()}

        def call(t, **over):
            kw = case.kwargs(**{n: t[n] for n in ("A_log", "dt_bias")}, **over)
            kw["initial_state"] = t.get("initial_state")
            return kda.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], backend=backend, **kw)

        full = leaves()
        o_all, ht_all = call(full)
        mine = leaves(span)
        o, ht = call(mine, cp_group=dist.group.WORLD)
        assert rel(o, o_all[:, span]) <= 1e-5, (rank, rel(o, o_all[:, span]))
        assert rel(ht, ht_all) <= 1e-5, (rank, rel(ht, ht_all))
        if not train:
            return
        w_h = torch.randn(ht_all.shape, generator=gen)
        ((o_all * w_o).sum() + (ht_all * w_h).sum()).backward()
        # The final state of each sequence carries its gradient on the rank where it ends.
        ends = torch.tensor(case.cu_seqlens[1:].tolist())
        owner = torch.tensor([max(r for r in range(world) if sum(slices[:r]) < e or r == 0) if e > 0 else 0
                              for e in ends.tolist()])  # fmt: skip
        here = (owner == rank).view(-1, 1, 1, 1)
        lens_t = torch.tensor(lens).view(-1, 1, 1, 1)
        here = here & (lens_t > 0)
        if rank == 0:  # empty sequences: their final state is the initial one; count it once
            here = here | (lens_t == 0)
        ((o * w_o[:, span]).sum() + (ht * w_h * here).sum()).backward()
        for n in ("q", "k", "v", "g", "beta"):
            got = mine[n].grad
            if slices[rank] == 0:  # an empty slice: its (empty) inputs take no part
                assert got is None or got.numel() == 0
                continue
            assert rel(got, full[n].grad[:, span]) <= 1e-4, (rank, n, rel(got, full[n].grad[:, span]))
        for n in names[5:]:  # shared parameters: summed over ranks (an empty slice adds nothing)
            total = torch.zeros_like(mine[n]) if mine[n].grad is None else mine[n].grad.clone()
            dist.all_reduce(total)
            assert rel(total, full[n].grad) <= 1e-4, (rank, n, rel(total, full[n].grad))
    finally:
        dist.destroy_process_group()


@exits_without_teardown
def _fla_context_worker(rank, world, store, lens):
    """fla's own contiguous cp_context (fla.ops.cp.build_cp_context) instead of cp_group."""
    from fla.ops.cp import build_cp_context

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        case = make_case(seq_lens=lens, H=1, HV=2, K=16, V=8, gate="lower_bound", seed=77)
        o_all, ht_all = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
        ctx = build_cp_context(case.cu_seqlens, group=dist.group.WORLD)
        part = sum(lens) // world
        span = slice(rank * part, (rank + 1) * part)
        local = [x[:, span].contiguous() for x in case.tensors()]
        o, ht = kda.chunk_kda(*local, backend="torch", cp_context=ctx, **case.kwargs(cu_seqlens=None))
        assert rel(o, o_all[:, span]) <= 1e-5, (rank, rel(o, o_all[:, span]))
        assert rel(ht, ht_all) <= 1e-5, (rank, rel(ht, ht_all))
    finally:
        dist.destroy_process_group()


@functools.cache
def interpreter_refusal() -> str:
    """What the Triton backend says of itself under TRITON_INTERPRET=1, asked in a fresh
    interpreter: this process may have imported Triton for the GPU, which fixes the mode."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from kda.triton import BACKEND; print(BACKEND.availability() or '')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


@exits_without_teardown
def _dtype_worker(rank, world, store, which):
    """The states' dtypes across ranks, batched and packed (a review, 2026-12-04): a bf16 initial
    state, which the unsharded call reads once and then carries in float32 (rank r > 0's start
    was rounded to bf16: o 1e-3 off), and float64 inputs, whose states are float64 (float32
    zeros made the packed path refuse its own initial state, or gather float32 beside float64)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        packed = which.endswith("packed")
        lens = [50, 30]  # packed: the first sequence crosses from rank 0 into rank 1
        shape = dict(seq_lens=lens) if packed else dict(B=2, T=world * T_LOCAL)
        case = make_case(**shape, H=1, HV=2, K=16, V=8, gate="precomputed", seed=77)
        case.g = case.g * 0.02  # gentle decays: the state carried across ranks shows in every output
        if which.startswith("float64"):
            case = case.to(torch.float64)
        kw = case.kwargs()
        if which.startswith("bf16 h0"):
            kw["initial_state"] = case.initial_state.bfloat16()
        elif "no h0" in which:
            kw["initial_state"] = None
        o_all, ht_all = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
        per = (sum(lens) if packed else world * T_LOCAL) // world
        span = slice(rank * per, (rank + 1) * per)
        local = [x[:, span].contiguous() for x in case.tensors()]
        o, ht = kda.chunk_kda(*local, backend="torch", cp_group=dist.group.WORLD, **kw)
        bar = 1e-12 if which.startswith("float64") else 1e-5
        assert ht.dtype == ht_all.dtype, (rank, ht.dtype, ht_all.dtype)
        assert rel(o.double(), o_all[:, span].double()) <= bar, (rank, rel(o.double(), o_all[:, span].double()))
        assert rel(ht.double(), ht_all.double()) <= bar, (rank, rel(ht.double(), ht_all.double()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", ["bf16 h0", "bf16 h0 packed", "float64", "float64 no h0 packed", "float64 packed"])
def test_sharded_call_keeps_the_unsharded_calls_state_dtypes(tmp_path, which):
    mp.spawn(_dtype_worker, args=(2, str(tmp_path / "store"), which), nprocs=2)


def spawn(tmp_path, monkeypatch, world, backend, layout=False, with_h0=True, mismatch=False, deprecated=False,
          gentle=False):  # fmt: skip
    if backend == "triton" and (why := interpreter_refusal()):
        pytest.skip(f"Triton under the interpreter is unavailable here: {why}")
    # The children inherit it (Triton on CPU tensors); monkeypatch restores this process's.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = (world, str(tmp_path / "store"), backend, layout, with_h0, mismatch, deprecated, gentle)
    mp.spawn(_worker, args=args, nprocs=world)


# gentle: gentle_decays (the others forget a rank's entering state within its slice)
@pytest.mark.parametrize(
    "world, backend, layout, with_h0, gentle",
    [(2, "torch", False, True, False), (2, "triton", True, True, True), (4, "torch", True, False, True),
     (4, "triton", False, True, False)],
)  # fmt: skip
def test_sharded_call_equals_the_unsharded_one(tmp_path, monkeypatch, world, backend, layout, with_h0, gentle):
    spawn(tmp_path, monkeypatch, world, backend, layout, with_h0, gentle=gentle)


@pytest.mark.filterwarnings("ignore:`transpose_state_layout` is deprecated")
def test_sharded_call_reads_the_deprecated_layout_name(tmp_path, monkeypatch):
    """``transpose_state_layout=True`` (fla's old name for ``state_v_first``) with a cp_group:
    the ranks' transitions in the V-first layout, as the unsharded call's (which validation
    folds the name into)."""
    spawn(tmp_path, monkeypatch, 2, "torch", layout=True, with_h0=True, deprecated=True)


@pytest.mark.parametrize(
    "world, backend, layout, with_h0, gentle",
    [(2, "torch", False, True, False), (4, "torch", True, True, True), (2, "triton", True, True, True),
     (3, "torch", False, False, False)],
)  # fmt: skip
def test_gradients_across_ranks_equal_the_unsharded_ones(
    tmp_path, monkeypatch, world, backend, layout, with_h0, gentle
):
    if backend == "triton" and (why := interpreter_refusal()):
        pytest.skip(f"Triton under the interpreter is unavailable here: {why}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = (world, str(tmp_path / "store"), backend, layout, with_h0, False, (16, 8), gentle)
    mp.spawn(_grad_worker, args=args, nprocs=world)


PACKED = [
    # (world, lens, slices): a sequence spanning every rank, and one starting mid-slice
    (2, [50, 7, 0, 23], [35, 45]),
    (4, [80], [20, 20, 20, 20]),
    # an empty slice between two that share a sequence, and whole sequences only
    (4, [12, 40, 28], [30, 0, 25, 25]),
    (2, [10, 20, 30, 20], [30, 50]),
]


@pytest.mark.parametrize("world, lens, slices", PACKED)
@pytest.mark.parametrize("train", [False, True])
def test_packed_sequences_across_ranks(tmp_path, monkeypatch, world, lens, slices, train):
    """cu_seqlens (the whole packed batch, the same on every rank) with slices of any length."""
    layout, with_h0 = sum(lens) % 2 == 0, len(lens) != 2
    mp.spawn(_packed_worker, args=(world, str(tmp_path / "store"), "torch", layout, with_h0, lens, slices, train),
             nprocs=world)  # fmt: skip


def test_packed_sequences_across_ranks_on_triton(tmp_path, monkeypatch):
    if why := interpreter_refusal():
        pytest.skip(f"Triton under the interpreter is unavailable here: {why}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mp.spawn(_packed_worker, args=(2, str(tmp_path / "store"), "triton", True, True, [50, 7, 0, 23], [35, 45], True),
             nprocs=2)  # fmt: skip


@pytest.mark.parametrize("KV", [(16, 16), (16, 32)], ids=["K=V", "K<V"])
def test_gradients_across_ranks_where_one_run_gives_the_transition(tmp_path, KV):
    """K <= V: a rank's P is the first K columns of one run's final state (a view that the
    gradients flow back through), batched and packed, both layouts, with decays gentle enough
    that P shows (the other tests' gates forget a rank's entering state within its slice)."""
    mp.spawn(_grad_worker, args=(2, str(tmp_path / "store"), "torch", True, True, False, KV, True), nprocs=2)
    packed = (2, str(tmp_path / "store2"), "torch", False, True, [50, 7, 0, 23], [35, 45], True, KV, True)
    mp.spawn(_packed_worker, args=packed, nprocs=2)


def test_only_the_initial_state_trains_across_ranks(tmp_path):
    """Every input frozen but the first rank's initial state: no rank may skip the backward's
    collective (a hang), and its gradient is the unsharded call's."""
    mp.spawn(_grad_worker, args=(2, str(tmp_path / "store"), "torch", False, True, True), nprocs=2)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")
@pytest.mark.parametrize("world, lens", [(2, [50, 7, 23]), (4, [90, 6, 24])])
def test_fla_cp_context_equals_the_unsharded_call(tmp_path, world, lens):
    """fla's contiguous cp_context: its local offsets and first/last-rank flags, turned into the
    whole batch's offsets (kda.context_parallel.from_fla_cp_context); a sequence spanning ranks."""
    mp.spawn(_fla_context_worker, args=(world, str(tmp_path / "store"), lens), nprocs=world)


@pytest.mark.parametrize(
    "ranks, offsets",
    [
        ([([10], True, False), ([6], False, True)], [0, 16]),  # one sequence over two ranks
        ([([4, 6], True, False), ([3, 5], False, True)], [0, 4, 13, 18]),  # packed, the middle one split
        ([([10], True, False), ([], False, False), ([6], False, True)], [0, 16]),  # past a rank of no tokens
        ([([10], True, True), ([], False, False), ([6], True, True)], [0, 10, 16]),
    ],
)
def test_fla_cp_context_offsets_from_the_ranks_pieces(monkeypatch, ranks, offsets):
    """from_fla_cp_context's whole-batch offsets from each rank's local lengths and first/last
    flags, with the gather stubbed (one process). A rank of no tokens passes a sequence on:
    until 2026-12-05 it ended it (a mutation audit found the case untested), which would have
    restarted the sequence's state on the next rank. fla's contiguous layout gives every rank
    an equal share, so it does not make such a rank itself."""
    from types import SimpleNamespace

    from kda import context_parallel

    rank = 1
    monkeypatch.setattr(dist, "get_world_size", lambda group: len(ranks))
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group: out.__setitem__(slice(None), ranks))
    lengths, first, last = ranks[rank]
    local = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    ctx = SimpleNamespace(layout="contiguous", group="g", cu_seqlens=local, cu_seqlens_cpu=local,
                          is_first_rank=first, is_last_rank=last)  # fmt: skip
    kw = {"cp_context": ctx}
    assert context_parallel.from_fla_cp_context(kw) == "g"
    assert kw["cu_seqlens"].tolist() == offsets and kw["cu_seqlens_cpu"].tolist() == offsets


def test_ranks_with_different_slices_fail_on_every_rank(tmp_path, monkeypatch):
    spawn(tmp_path, monkeypatch, 2, "torch", mismatch=True)


def test_cp_group_refusals():
    case = make_case(B=1, T=20, H=1, K=16, V=8, seed=72)
    with pytest.raises(ValueError, match="initialised torch.distributed"):
        kda.chunk_kda(*case.tensors(), cp_group=object(), **case.kwargs())


# (name, overrides of the call's arguments by rank (None: every rank), the error expected on
# each rank: the refused rank's own, the other's "rank r refused"). The ranks go through them one
# after another in one process group, so a rank left in a collective would hang the next case
# (the group's timeout fails it) or pair it with the wrong one.
OFFSETS = [0, 12, 12, 25, 30]  # packed over 2 ranks of 15 tokens: a sequence crosses, one is empty
CP_REFUSALS = [
    ("offsets not non-decreasing", {None: dict(cu_seqlens=[0, 12, 8, 25, 30])}, {0: "non-decr", 1: "non-decr"}),
    ("offsets not from 0", {None: dict(cu_seqlens=[3, 12, 12, 25, 30])}, {0: "start at 0", 1: "start at 0"}),
    ("host copy disagrees", {None: dict(cu_seqlens_cpu=[0, 12, 12, 20, 30])}, {0: "disagrees", 1: "disagrees"}),
    ("float offsets on rank 1", {1: dict(cu_seqlens=[0.0, 12, 12, 25, 30])}, {0: "rank 1 refused", 1: "int64"}),
    ("state [N, HV, V, K] on rank 0", {0: dict(initial_state="swapped")}, {0: "initial_state", 1: "rank 0 refused"}),
    ("fp16 state on rank 1", {1: dict(initial_state="fp16")}, {0: "rank 1 refused", 1: "initial_state"}),
    ("q 3-D on rank 1", {1: dict(q="3-D")}, {0: "rank 1 refused", 1: "`q` must be"}),
    ("B = 2 with offsets", {None: dict(B=2)}, {0: "batch size must be 1", 1: "batch size must be 1"}),
    ("offsets on rank 0 only", {1: dict(cu_seqlens=None, initial_state=None)}, {0: "differ", 1: "differ"}),
    ("other offsets, same weighted sum", {1: dict(cu_seqlens=[0, 13, 13, 24, 30])}, {0: "differ", 1: "differ"}),
    ("final state on rank 0 only", {1: dict(output_final_state=False)}, {0: "differ", 1: "differ"}),
    ("pool indices on rank 0", {0: dict(initial_state_indices=[0, 1, 2, 3])}, {0: "_indices", 1: "rank 0 refused"}),
    ("use_graph, max_num_seqs 2", {None: dict(use_graph=True, max_num_seqs=2)}, {0: "max_num", 1: "max_num"}),
]  # fmt: skip


@exits_without_teardown
def _refusal_worker(rank, world, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        case = make_case(seq_lens=[12, 0, 13, 5], H=1, HV=2, K=16, V=8, gate="lower_bound", seed=77)
        span = slice(15 * rank, 15 * rank + 15)
        for name, overrides, expected in CP_REFUSALS:
            over = dict(overrides.get(None, {}), **overrides.get(rank, {}))
            q, k, v, g, beta = (x[:, span].contiguous() for x in case.tensors())
            if over.pop("B", None) == 2:
                q, k, v, g, beta = (torch.cat([x, x]) for x in (q, k, v, g, beta))
            kw = case.kwargs(cu_seqlens=torch.tensor(OFFSETS), cu_seqlens_cpu=None)
            for key in ("cu_seqlens", "cu_seqlens_cpu", "initial_state_indices"):
                if key in over and over[key] is not None:
                    over[key] = torch.tensor(over[key])
            h0, state = kw["initial_state"], over.pop("initial_state", kw["initial_state"])
            if isinstance(state, str):
                state = h0.transpose(-1, -2) if state == "swapped" else h0.half()
            kw["initial_state"] = state
            if over.pop("q", None) == "3-D":
                q = q[0]
            kw.update(over)
            with pytest.raises((ValueError, TypeError), match=expected[rank]) as info:
                kda.chunk_kda(q, k, v, g, beta, cp_group=dist.group.WORLD, backend="torch", **kw)
            print(f"rank {rank}, {name}: {type(info.value).__name__}: {info.value}", flush=True)
        # and the group still pairs up: a good call after the refusals equals the unsharded one
        # (with fla's use_graph, of the whole batch's 4 sequences: the ranks' pieces, whose offsets
        # count others, were checked against it until a review of 2026-12-07)
        o_all, ht_all = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
        kw = case.kwargs(cu_seqlens=torch.tensor(OFFSETS), cu_seqlens_cpu=None, use_graph=True, max_num_seqs=4)
        o, ht = kda.chunk_kda(*(x[:, span].contiguous() for x in case.tensors()), cp_group=dist.group.WORLD,
                              backend="torch", **kw)  # fmt: skip
        assert rel(o, o_all[:, span]) <= 1e-5 and rel(ht, ht_all) <= 1e-5
    finally:
        dist.destroy_process_group()


def test_bad_arguments_fail_on_every_rank_and_leave_the_group_paired(tmp_path):
    """Every rank checks its arguments as an ordinary call's before any collective, and the first
    collective carries whether it refused them: each refusal raises on every rank (the refused
    rank's own ValueError or TypeError naming the argument, the others' naming that rank), and
    shapes, offsets or output_final_state that differ between ranks fail on every rank. A review
    of 2026-12-07 found bad offsets computing wrong answers, one-rank errors leaving the other
    ranks in a collective, offsets on one rank only aborting the process (gloo), and
    output_final_state on one rank only hanging until the group's timeout."""
    mp.spawn(_refusal_worker, args=(2, str(tmp_path / "store")), nprocs=2)
