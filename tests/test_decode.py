"""The one-launch decode kernel (kda.triton.decode) on plain calls: 1 to 64 tokens per
sequence against the float64 token loop for every flag and both launch shapes; calls whose
longest sequence is short take it (fused_recurrent_kda up to dispatch.RECURRENT_DECODE_TOKENS,
chunk_kda up to dispatch.CHUNK_DECODE_TOKENS), and the dispatch record proves it ran. Pools through the same kernel:
tests/test_pools.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import kda
from helpers import DEVICE, assert_close_fp64, fp64_reference, make_case
from kda import dispatch
from kda.api import checked_problem
from kda.triton.decode import decode

# float32 inputs: the loop in float32 against float64. 16-bit inputs: their rounding, as the
# chunk kernels' bar (tests/test_triton.py), and the interpreter truncates (twice the error).
BAR = {torch.float32: 1e-5, torch.bfloat16: 5e-3 if DEVICE == "cuda" else 2e-2}


def decode_call(case, backend="triton", fn=kda.fused_recurrent_kda, **over):
    kw = case.kwargs(**over)
    kw.pop("safe_gate", None)
    with kda.record_dispatch() as events:
        o, ht = fn(*case.tensors(), backend=backend, **kw)
    return o, ht, events


@given(
    lens=st.one_of(st.lists(st.integers(0, 64), min_size=1, max_size=3), st.none()),
    batch=st.integers(1, 3),
    T=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    gate=st.sampled_from(["precomputed", "lower_bound", "softplus"]),
    K=st.sampled_from([8, 20, 32]),
    V=st.sampled_from([8, 24, 40]),
    group=st.sampled_from([1, 2]),
    layout=st.booleans(),
    l2norm=st.booleans(),
    neg_eigval=st.booleans(),
    state=st.sampled_from(["none", "float32", "bfloat16"]),
    final_bf16=st.booleans(),
    launch=st.sampled_from([None, (16, 1), (8, 2)]),
    seed=st.integers(0, 9999),
)
@example(lens=[64, 0, 1], batch=1, T=1, dtype=torch.float32, gate="softplus", K=20, V=40, group=2, layout=True,
         l2norm=True, neg_eigval=True, state="bfloat16", final_bf16=False, launch=(16, 1), seed=3)  # fmt: skip
def test_decode_kernel_matches_the_fp64_token_loop(
    lens, batch, T, dtype, gate, K, V, group, layout, l2norm, neg_eigval, state, final_bf16, launch, seed
):  # fmt: skip
    """The kernel itself (kda.triton.decode.decode), at its chosen launch shape or a forced
    one (``launch``: V columns, warps)."""
    shape = dict(seq_lens=lens) if lens is not None else dict(B=batch, T=T)
    case = make_case(**shape, H=1, HV=group, K=K, V=V, dtype=dtype, gate=gate, state_v_first=layout,
                     with_state=state != "none", device=DEVICE, seed=seed, steep_steps=1)  # fmt: skip
    case.l2norm = l2norm
    if state == "bfloat16":
        case.initial_state = case.initial_state.to(torch.bfloat16)
    final_dtype = torch.bfloat16 if final_bf16 else torch.float32
    kw = case.kwargs(allow_neg_eigval=neg_eigval, final_state_dtype=final_dtype)
    kw.pop("safe_gate", None)
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    o, ht = decode(p, *(launch or ()))
    assert o.dtype == dtype and ht.dtype == final_dtype
    o_ref, ht_ref = fp64_reference(case, allow_neg_eigval=neg_eigval)
    state_bar = max(BAR[dtype], 5e-3 if final_bf16 else 0.0)  # a bf16 final state: its own rounding
    assert_close_fp64(o, o_ref, BAR[dtype], "o")
    assert_close_fp64(ht, ht_ref, state_bar, "final state")


def test_no_final_state_asked_none_returned():
    case = make_case(B=2, T=dispatch.RECURRENT_DECODE_TOKENS, H=1, K=16, V=16, device=DEVICE, seed=81)
    o, ht, events = decode_call(case, output_final_state=False)
    assert ht is None and "triton:decode" in events
    o_ref, _ = fp64_reference(case)
    assert_close_fp64(o, o_ref, BAR[torch.float32], "o")


@pytest.mark.parametrize(
    "fn, tokens, kernel",
    [
        (kda.fused_recurrent_kda, dispatch.RECURRENT_DECODE_TOKENS, "triton:decode"),
        (kda.fused_recurrent_kda, dispatch.RECURRENT_DECODE_TOKENS + 1, "triton:recurrence_v_split"),
        (kda.chunk_kda, dispatch.CHUNK_DECODE_TOKENS, "triton:decode"),
        (kda.chunk_kda, dispatch.CHUNK_DECODE_TOKENS + 1, "triton:recurrence_v_split"),
    ],
)
@pytest.mark.parametrize("varlen", [True, False])
def test_short_sequences_take_the_decode_kernel_longer_ones_the_chunks(fn, tokens, kernel, varlen):
    """The longest sequence decides (varlen: one long sequence among short ones; batched: one
    sequence of exactly the limit, where the router's shortcut on the mean meets it, a boundary
    a mutation audit of 2026-12-05 found untested), and both paths give the token loop's
    answer."""
    shape = dict(seq_lens=[1, tokens, 2]) if varlen else dict(B=1, T=tokens)
    case = make_case(**shape, H=1, K=16, V=16, device=DEVICE, seed=82)
    o, ht, events = decode_call(case, fn=fn)
    assert kernel in events, events
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, 1e-4, "o")
    assert_close_fp64(ht, ht_ref, 1e-4, "final state")


def test_calls_with_grad_keep_the_chunk_kernels():
    """The decode kernel has no backward: a call that trains goes through the custom op."""
    case = make_case(B=1, T=1, H=1, K=16, V=16, device=DEVICE, seed=83)
    q = case.q.clone().requires_grad_()
    kw = case.kwargs()
    kw.pop("safe_gate", None)
    with kda.record_dispatch() as events:
        o, _ = kda.fused_recurrent_kda(q, *case.tensors()[1:], backend="triton", **kw)
    assert "triton:decode" not in events, events
    o.sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


@pytest.mark.gpu
def test_gpu_auto_decodes_on_triton_and_says_why_not_cuda():
    """A bf16 decode step with V = 256 (which the CUDA kernels do not take) goes to Triton's
    decode kernel under auto; 64 sequences, against the float64 loop."""
    case = make_case(B=64, T=1, H=4, K=128, V=256, dtype=torch.bfloat16, device="cuda", seed=84)
    o, ht, events = decode_call(case, backend="auto")
    assert events[:2] == ["fused_recurrent_kda -> triton", "triton:decode"], events
    kw = {name: x for name, x in case.kwargs().items() if name != "safe_gate"}
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    assert dispatch.get_backend("cuda").rejects(p).startswith("head dims K=128, V=256"), p.describe()
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, BAR[torch.bfloat16], "o")
    assert_close_fp64(ht, ht_ref, BAR[torch.bfloat16], "final state")


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph_with_new_inputs():
    """Captured once, replayed with new tokens and states copied into the captured inputs:
    each replay equals an eager call on the same values."""
    case = make_case(B=8, T=1, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=85)
    kw = case.kwargs()
    kw.pop("safe_gate", None)
    args = list(case.tensors())
    h0 = kw["initial_state"]
    kda.fused_recurrent_kda(*args, **kw)  # warm: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = kda.fused_recurrent_kda(*args, **kw)
    for seed in (86, 87):
        fresh = make_case(B=8, T=1, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=seed)
        for x, y in zip(args, fresh.tensors()):
            x.copy_(y)
        h0.copy_(fresh.initial_state)
        graph.replay()
        want_o, want_ht = kda.fused_recurrent_kda(*fresh.tensors(), **{**kw, "initial_state": fresh.initial_state})
        assert torch.equal(o, want_o) and torch.equal(ht, want_ht)


@pytest.mark.gpu
def test_gpu_decode_of_more_than_65535_sequence_heads():
    """2100 sequences x 32 value heads: the grid is one dimension (a second one stops at
    65535), every output checked against the float64 loop, and the 1,665 (sequence, head) pairs
    from the 65,535th on by themselves. (2048 sequences until 2026-12-06: one pair past the
    limit, which left unwritten moved the whole output's error from 1.7e-3 to 4.2e-3, under the
    5e-3 bar, by a CPU count.)"""
    K = V = 16
    case = make_case(B=2100, T=1, H=32, K=K, V=V, dtype=torch.bfloat16, device="cuda", seed=88)
    o, ht, events = decode_call(case, backend="auto")
    assert "triton:decode" in events, events
    o_ref, ht_ref = fp64_reference(case)
    assert_close_fp64(o, o_ref, BAR[torch.bfloat16], "o")
    assert_close_fp64(ht, ht_ref, BAR[torch.bfloat16], "final state")
    # rows by (sequence, head): o is [B, 1, HV, V], ht [B, HV, K, V]
    past, bar = 65535, BAR[torch.bfloat16]
    assert_close_fp64(o.reshape(-1, V)[past:], o_ref.reshape(-1, V)[past:], bar, "o past 65535")
    assert_close_fp64(ht.reshape(-1, K * V)[past:], ht_ref.reshape(-1, K * V)[past:], bar, "ht past 65535")
