"""The CUDA decode kernel (src/kda/cuda/decode.cu, kda.cuda.decode) on a Hopper GPU: the
float64 token loop for every flag it takes, state pools with every slot not named poisoned
and checked untouched bit for bit, what auto sends it, and graph replay with new indices.
The host side of its launch (the DecodeParams block) is checked on any machine in
tests/test_cuda_launch.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda
from helpers import assert_close_fp64, cuda_ready, fp64_reference, make_case, recurrent_kwargs, rel, start_states
from kda import abi
from kda.api import checked_problem
from kda.cuda import BACKEND

pytestmark = [pytest.mark.gpu, cuda_ready]

D = 128  # the kernel's K = V
O_BAR = 5e-3  # o is bf16: its rounding (the arithmetic is float32 against float64 on the same inputs)
STATE_BAR = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


def decode_case(lens=None, B=1, T=1, HV=2, group=1, gate="lower_bound", layout=False, seed=0, with_state=True):
    shape = dict(seq_lens=lens) if lens is not None else dict(B=B, T=T)
    return make_case(**shape, H=HV // group, HV=HV, K=D, V=D, dtype=torch.bfloat16, gate=gate, state_v_first=layout,
                     with_state=with_state, device="cuda", seed=seed)  # fmt: skip


@given(
    lens=st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
    batch=st.integers(1, 3),
    T=st.integers(1, 9),
    state=st.sampled_from(["float32", "bfloat16", "bfloat16_to_float32", "none"]),
    gate=st.sampled_from(["precomputed", "lower_bound"]),
    group=st.sampled_from([1, 2]),
    layout=st.booleans(),
    l2norm=st.booleans(),
    neg_eigval=st.booleans(),
    narrow=st.booleans(),  # g and beta in bf16 (else float32)
    columns=st.sampled_from(abi.DECODE_COLUMNS),
    seed=st.integers(0, 9999),
)
def test_gpu_cuda_decode_matches_the_fp64_token_loop(
    lens, batch, T, state, gate, group, layout, l2norm, neg_eigval, narrow, columns, seed
):  # fmt: skip
    # the state read, and the final state: a bf16 state may be written back in float32 (decode.cu's
    # _to_f32 entries, 2026-12-07: a plain call's default final state)
    dtype = torch.bfloat16 if state.startswith("bfloat16") else torch.float32
    final = torch.float32 if state == "bfloat16_to_float32" else dtype
    if dtype == torch.bfloat16:  # the kernel keeps a bf16 state in bf16: one token a sequence, or none
        lens, T = (None if lens is None else [min(n, 1) for n in lens]), 1
    case = decode_case(lens, batch, T, HV=2, group=group, gate=gate, layout=layout, seed=seed,
                       with_state=state != "none")  # fmt: skip
    case.l2norm = l2norm
    if narrow:
        case.g, case.beta = case.g.bfloat16(), case.beta.bfloat16()
    if case.initial_state is not None:
        case.initial_state = case.initial_state.to(dtype)
    kw = recurrent_kwargs(case, allow_neg_eigval=neg_eigval, final_state_dtype=final)
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    assert BACKEND.rejects(p) is None, BACKEND.rejects(p)
    from kda.cuda.decode import decode

    o, ht = decode(p, columns)
    torch.cuda.synchronize()
    o_ref, ht_ref = fp64_reference(case, allow_neg_eigval=neg_eigval)
    assert ht.dtype == final
    assert_close_fp64(o, o_ref, O_BAR, "o")
    assert_close_fp64(ht, ht_ref, STATE_BAR[final], "final state")


def pool_of(P, HV, layout, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(P, HV, D, D, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_cuda_pool_reads_and_writes_the_named_slots_only(pool_dtype, layout, index_dtype):
    """One token for each of five sequences through slots 5, 2 and 0; -1 is padding and 9 is
    out of range (P = 7): both start from zeros and write nothing."""
    slots = [5, -1, 2, 9, 0]
    case = decode_case(B=len(slots), T=1, HV=4, group=2, layout=layout, seed=31)
    pool = pool_of(7, 4, layout, pool_dtype, seed=32)
    before = pool.clone()
    idx = torch.tensor(slots, dtype=index_dtype, device="cuda")
    with kda.record_dispatch() as events:
        o, out = kda.fused_recurrent_kda(*case.tensors(), **recurrent_kwargs(case, initial_state=pool),
                                         inplace_final_state=True, ssm_state_indices=idx, backend="cuda")  # fmt: skip
    assert out is pool and "cuda:pooled_decode" in events, events
    case.initial_state = start_states(before, slots, torch.float32)
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, O_BAR, "o")
    for n, s in enumerate(slots):
        if 0 <= s < 7:
            assert rel(pool[s].float(), ht_ref[n]) <= STATE_BAR[pool_dtype], (n, s)
    untouched = [s for s in range(7) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched]), "a slot not named changed"


def test_gpu_cuda_pool_with_2d_indices_and_accepted_tokens():
    """Speculative decoding: sequence n starts from indices[n, accepted[n] - 1] (counts outside
    [1, S] clamped into the row) and writes the state after its token t to indices[n, t];
    padding (-1) and out-of-range slots are skipped. Against the torch backend's pool (the
    float64 token loop of reference.pooled_recurrent_kda) on the same values."""
    lens, P = [3, 1, 4, 2], 12
    idx = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7], [8, 20, -1, -1]], device="cuda")
    accepted = torch.tensor([2, 1, 9, 0], device="cuda")  # 9 and 0: clamped to 4 and 1
    case = decode_case(lens, HV=2, seed=33)
    pool = pool_of(P, 2, False, torch.float32, seed=34)
    before = pool.clone()
    with kda.record_dispatch() as events:
        o, _ = kda.fused_recurrent_kda(*case.tensors(), **recurrent_kwargs(case, initial_state=pool),
                                       inplace_final_state=True, ssm_state_indices=idx,
                                       num_accepted_tokens=accepted, backend="cuda")  # fmt: skip
    assert "cuda:pooled_decode" in events, events
    c64 = case.to(torch.float64, "cpu")
    model = before.double().cpu()
    o_ref, _ = kda.fused_recurrent_kda(*c64.tensors(), **recurrent_kwargs(c64, initial_state=model),
                                       inplace_final_state=True, ssm_state_indices=idx.cpu(),
                                       num_accepted_tokens=accepted.cpu(), backend="torch")  # fmt: skip
    assert_close_fp64(o, o_ref, O_BAR, "o")
    written = {int(s) for s in idx.flatten() if 0 <= s < P}
    for s in range(P):
        if s in written:
            assert rel(pool[s], model[s]) <= STATE_BAR[torch.float32], s
        else:
            assert torch.equal(pool[s], before[s]), f"slot {s}, not named, changed"


def test_gpu_auto_runs_large_decode_grids_on_cuda_and_the_rest_on_triton():
    """auto takes the CUDA kernel where it measured faster (kda.cuda.decode.AUTO_MIN_PAIRS):
    one-token bf16 states over 1024 sequence-heads; small grids of either state dtype and bf16
    states over several tokens go to Triton's decode kernel, and the refusal says why."""
    from kda.cuda.decode import AUTO_MIN_PAIRS

    pairs = AUTO_MIN_PAIRS[("bfloat16", False)]
    case = decode_case(B=pairs // 4, T=1, HV=4, group=2, seed=35)
    case.initial_state = case.initial_state.bfloat16()
    kw = recurrent_kwargs(case, final_state_dtype=torch.bfloat16)
    with kda.record_dispatch() as events:
        o, ht = kda.fused_recurrent_kda(*case.tensors(), **kw)
    assert events[:2] == ["fused_recurrent_kda -> cuda", "cuda:decode"], events
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, O_BAR, "o")
    assert_close_fp64(ht, ht_ref, STATE_BAR[torch.bfloat16], "final state")
    # a bf16 state written back in float32 (the default final state) takes the CUDA kernel too, and
    # writes every element: a NaN block of the final state's size, freed just before, is what the
    # caching allocator most likely hands the call for it (an unwritten element reads NaN)
    kw32 = recurrent_kwargs(case)
    poison = torch.full(case.initial_state.shape, float("nan"), device="cuda")
    del poison
    with kda.record_dispatch() as events:
        o32, ht32 = kda.fused_recurrent_kda(*case.tensors(), **kw32)
    assert events[:2] == ["fused_recurrent_kda -> cuda", "cuda:decode"], events
    assert ht32.dtype == torch.float32
    # (not bit for bit o's: that entry sums over K in 8-byte runs, 2026-12-07, run 206)
    assert_close_fp64(o32, o_ref, O_BAR, "o beside a float32 final state")
    assert_close_fp64(ht32, ht_ref, STATE_BAR[torch.float32], "float32 final state from a bf16 state")
    for over, says in (
        (dict(B=pairs // 8, state=torch.float32), f"{pairs // 2} (sequence, head) pairs of float32 states"),
        (dict(B=8), "32 (sequence, head) pairs of bfloat16 states"),
        (dict(T=3), "bfloat16 states over more than one token"),
    ):
        small = decode_case(B=over.get("B", pairs // 4), T=over.get("T", 1), HV=4, group=2, seed=36)
        dtype = over.get("state", torch.bfloat16)
        small.initial_state = small.initial_state.to(dtype)
        kw = recurrent_kwargs(small, final_state_dtype=dtype)
        with kda.record_dispatch() as events:
            kda.fused_recurrent_kda(*small.tensors(), **kw)
        assert events[:2] == ["fused_recurrent_kda -> triton", "triton:decode"], (says, events)
        p = checked_problem(kda.fused_recurrent_kda, *small.tensors(), **kw)
        assert says in BACKEND.auto_rejects(p), BACKEND.auto_rejects(p)


def test_gpu_cuda_pool_decode_replays_in_a_graph_with_new_indices_and_tokens():
    """Captured once; each replay after new tokens and new slot indices are copied into the
    captured inputs equals an eager call on the same values, pool included."""
    case = decode_case(B=6, T=1, HV=2, seed=36)
    pool = pool_of(9, 2, False, torch.float32, seed=37)
    idx = torch.tensor([0, 3, -1, 8, 2, 5], dtype=torch.int32, device="cuda")
    args = list(case.tensors())
    kw = recurrent_kwargs(case, initial_state=pool)

    def call():
        return kda.fused_recurrent_kda(*args, **kw, inplace_final_state=True, ssm_state_indices=idx, backend="cuda")

    start = pool.clone()
    call()  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = call()
    for seed in (38, 39):
        fresh = decode_case(B=6, T=1, HV=2, seed=seed)
        for x, y in zip(args, fresh.tensors()):
            x.copy_(y)
        idx.copy_(torch.randperm(9, device="cuda")[:6].int())
        pool.copy_(start)
        graph.replay()
        replayed_o, replayed_pool = o.clone(), pool.clone()
        pool.copy_(start)
        want_o, _ = call()
        assert torch.equal(replayed_o, want_o) and torch.equal(replayed_pool, pool)


def test_gpu_cuda_sequence_with_no_tokens_leaves_a_shared_slot_alone():
    """Sequences 0 and 2 name slot 1, sequence 2 has no tokens: slot 1 ends as sequence 0 left
    it, as the torch loop gives. That is the semantics; the race a write-back from the empty
    sequence would start is not seen here, since that CTA, with no token loop, stores first, and
    what it would store is the value it read. The kernel's guard (decode.cu: no store back when
    p.h0 == p.ht) has no outside check; Triton's has one (test_pools.py, a review, 2026-12-06)."""
    lens, slots, P = [3, 2, 0], [1, 4, 1], 6
    case = decode_case(lens, HV=2, seed=40)
    pool = pool_of(P, 2, False, torch.float32, seed=41)
    before = pool.clone()
    idx = torch.tensor(slots, device="cuda")
    kda.fused_recurrent_kda(*case.tensors(), **recurrent_kwargs(case, initial_state=pool), inplace_final_state=True,
                            ssm_state_indices=idx, backend="cuda")  # fmt: skip
    c64 = case.to(torch.float64, "cpu")
    model = before.double().cpu()
    kda.fused_recurrent_kda(*c64.tensors(), **recurrent_kwargs(c64, initial_state=model), inplace_final_state=True,
                            ssm_state_indices=idx.cpu(), backend="torch")  # fmt: skip
    for s in (1, 4):
        assert rel(pool[s], model[s]) <= STATE_BAR[torch.float32], s
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
