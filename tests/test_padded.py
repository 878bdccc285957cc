"""Padded token buffers: ``cu_seqlens`` ending before T, as fla's ``use_graph`` and serving engines
pass them (a buffer of fixed T, the offsets padded with empty sequences). The call equals the
one on the covered rows; the output's rows past the end are zeros and their gradients are zero.
(Refused with "must end at T" until a review of fla drop-in parity, 2026-12-07: fla's
fused_recurrent_kda takes such buffers and zero-fills the rows, its chunk_kda leaves them
undefined.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kda
from helpers import AUTO, DEVICE, cuda_ready, make_case, recurrent_kwargs
from kda import validation

SEQ_LENS = [5, 0, 12, 0]  # 17 covered rows; the empty tail is fla's use_graph padding
PAD = 9
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def padded_case(dtype: torch.dtype, device: str, K: int, seed: int, H: int = 1):
    """``(case on the covered rows, the same with PAD random rows appended)``: the padding holds
    random numbers, never zeros, so a kernel that read it would show."""
    case = make_case(seq_lens=SEQ_LENS, H=H, HV=2, K=K, V=K, gate="lower_bound", dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tails = {}
    for name in ("q", "k", "v", "g", "beta"):
        x = getattr(case, name)
        tails[name] = torch.cat([x, torch.randn(1, PAD, *x.shape[2:], generator=gen).to(device, dtype)], dim=1)
    return case, dataclasses.replace(case, **tails)


def call(op: str, case, backend: str, **over):
    kw = case.kwargs(**over) if op == "chunk_kda" else recurrent_kwargs(case, **over)
    return getattr(kda, op)(*case.tensors(), backend=backend, **kw)


def backends_here() -> list:
    cuda = pytest.param("cuda", marks=[pytest.mark.gpu, cuda_ready])
    return ["torch", AUTO, cuda]


def case_for(backend: str, seed: int):
    if backend == "cuda":  # the CUDA kernels' scope: bf16, K = V = 128, H = HV past decode shapes
        return padded_case(torch.bfloat16, "cuda", 128, seed, H=2)
    return padded_case(torch.float32, DEVICE if backend == "auto" else "cpu", 16, seed)


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("backend", backends_here())
def test_padded_buffer_is_the_covered_call_and_zeros(op, backend):
    case, padded = case_for(backend, seed=71)
    o, ht = call(op, case, backend)
    with kda.record_dispatch() as events:
        o_pad, ht_pad = call(op, padded, backend)
    ran = f"{op} -> {'' if backend == 'auto' else backend}"
    assert any(e.startswith(ran) for e in events), events
    assert o_pad.shape == padded.v.shape
    assert torch.equal(o_pad[:, : o.shape[1]], o), "the covered rows differ from the covered call's"
    assert (o_pad[:, o.shape[1] :] == 0).all(), "the padding rows are not zero"
    assert torch.equal(ht_pad, ht)


@pytest.mark.parametrize("backend", backends_here())
def test_padded_buffer_gradients_are_the_covered_calls_and_zero_on_padding(backend):
    case, padded = case_for(backend, seed=72)
    covered = case.q.shape[1]
    gen = torch.Generator().manual_seed(77)
    do = torch.randn(padded.v.shape, generator=gen).to(case.v.device, case.v.dtype)
    dht = torch.randn(case.initial_state.shape, generator=gen).to(case.v.device)
    grads = []
    for c, rows in ((case, covered), (padded, covered + PAD)):
        leaves = {name: getattr(c, name).detach().clone().requires_grad_() for name in GRAD_NAMES}
        kw = c.kwargs(**{name: leaves[name] for name in ("initial_state", "A_log", "dt_bias")})
        o, ht = kda.chunk_kda(*(leaves[name] for name in ("q", "k", "v", "g", "beta")), backend=backend, **kw)
        loss = (o * do[:, :rows]).sum() + (ht * dht).sum()
        grads.append(dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))))
    for name in GRAD_NAMES:
        ours, theirs = grads[1][name], grads[0][name]
        if name in ("q", "k", "v", "g", "beta"):
            assert (ours[:, covered:] == 0).all(), f"d{name} is not zero on the padding"
            ours = ours[:, :covered]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"d{name}")


@pytest.mark.parametrize("backend", ["torch", AUTO])
def test_padded_buffer_through_state_pools(backend):
    """fused_recurrent_kda's pool and chunk_kda's initial_state_indices on a padded buffer: the
    pool ends as after the covered call, the padding rows of o are zero."""
    case, padded = case_for(backend, seed=73)
    N = len(SEQ_LENS)
    gen = torch.Generator().manual_seed(74)
    pool = torch.randn(N + 2, 2, 16, 16, generator=gen).to(case.q.device)
    slots = torch.tensor([3, -1, 0, 5], device=case.q.device)
    for op, pool_kw in (
        ("fused_recurrent_kda", dict(inplace_final_state=True, ssm_state_indices=slots)),
        ("chunk_kda", dict(initial_state_indices=slots)),
    ):
        pools = []
        outs = []
        for c in (case, padded):
            p = pool.clone()
            o, _ = call(op, c, backend, initial_state=p, **pool_kw)
            pools.append(p)
            outs.append(o)
        assert torch.equal(pools[1], pools[0]), op
        assert not torch.equal(pools[0], pool), f"{op}: the pool was not written"
        assert torch.equal(outs[1][:, : case.q.shape[1]], outs[0]), op
        assert (outs[1][:, case.q.shape[1] :] == 0).all(), op


@pytest.mark.gpu
@cuda_ready
def test_gpu_compiled_padded_buffer_on_the_cuda_route_is_eagers():
    """torch.compile(fullgraph=True) of a training call on a padded buffer where auto takes the CUDA
    forward: under compile the offsets are read where kda::chunk_fwd runs, the kernels cover the
    rows up to the end only, and the rows past it are zeroed in o and in the input gradients
    (autograd._zero_padding). Outputs and gradients equal the eager call's on the same route
    (seen-not-fixed until 2026-12-07: that route was tested on the CPU stand-in only)."""
    import torch._dynamo

    _, padded = case_for("cuda", seed=79)
    covered = sum(SEQ_LENS)
    gen = torch.Generator().manual_seed(80)
    do = torch.randn(padded.v.shape, generator=gen).to("cuda", padded.v.dtype)

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        o, ht = kda.chunk_kda(q, k, v, g, beta, **padded.kwargs(initial_state=h0, A_log=A_log, dt_bias=dt_bias))
        return (o.float() * do.float()).sum() + ht.square().sum(), o, ht

    def run(fn):
        leaves = {name: getattr(padded, name).detach().clone().requires_grad_() for name in GRAD_NAMES}
        loss, o, ht = fn(*leaves.values())
        return o.detach(), ht.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    torch._dynamo.reset()
    with kda.record_dispatch() as events:
        o, ht, grads = run(torch.compile(f, fullgraph=True))
    assert "cuda:recurrence" in events, events
    o_e, ht_e, grads_e = run(f)
    assert (o[:, covered:] == 0).all(), "the padding rows of o are not zero"
    torch.testing.assert_close(o, o_e, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_e, rtol=0, atol=0)
    for name in GRAD_NAMES:
        if name in ("q", "k", "v", "g", "beta"):
            assert (grads[name][:, covered:] == 0).all(), f"d{name} is not zero on the padding"
        assert torch.isfinite(grads[name]).all(), name
        torch.testing.assert_close(grads[name], grads_e[name], rtol=2e-2, atol=1e-3, msg=f"d{name}")


def test_cu_seqlens_past_t_and_use_graph_offsets_are_refused():
    case, padded = case_for("torch", seed=75)
    end = case.q.shape[1]
    with pytest.raises(ValueError, match="must end at most at T"):
        kda.chunk_kda(*case.tensors(), **case.kwargs(cu_seqlens=torch.tensor([0, end + 1])))
    # fla's graph mode: the offsets padded with empty sequences to max_num_seqs + 1 entries
    o, _ = kda.chunk_kda(*padded.tensors(), **padded.kwargs(), use_graph=True, max_num_seqs=len(SEQ_LENS))
    assert (o[:, end:] == 0).all()
    with pytest.raises(ValueError, match="`max_num_seqs`"):
        kda.chunk_kda(*padded.tensors(), **padded.kwargs(), use_graph=True, max_num_seqs=len(SEQ_LENS) + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: offsets on the device")
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
def test_gpu_unchecked_padded_buffer_computes_the_covered_rows(op, monkeypatch):
    """Offsets never read on the host (KDA_CHECK_CU_SEQLENS=0, or a CUDA-graph capture): the call
    cannot know where the buffer ends, so it runs on all T rows; the covered rows must still be
    the covered call's (the rows past the end are left undefined, as fla's chunk_kda says)."""
    case, padded = case_for("auto", seed=76)
    o, ht = call(op, case, "auto")
    monkeypatch.setattr(validation, "CHECK_CU_SEQLENS", "0")
    o_pad, ht_pad = call(op, padded, "auto")
    covered = case.q.shape[1]
    torch.testing.assert_close(o_pad[:, :covered], o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht_pad, ht, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a CUDA-graph capture")
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
def test_gpu_graph_of_a_padded_buffer_replays_with_more_rows_covered(op):
    """A capture given host offsets that end before T must not bake that end into the graph: a
    replay whose offsets cover more rows (the serving pattern: a buffer of fixed T, new lengths
    every step) computes them all. Under a capture the call runs on all T rows and the kernels
    read the end from `cu_seqlens`."""
    case, padded = case_for("auto", seed=78)
    T = padded.q.shape[1]
    cu = padded.cu_seqlens.clone()
    wider = torch.tensor([0, 5, 9, T - 2, T - 2], device=cu.device)  # same N, covers T - 2 rows
    kw = (padded.kwargs if op == "chunk_kda" else lambda **o: recurrent_kwargs(padded, **o))(
        cu_seqlens=cu, cu_seqlens_cpu=cu.cpu()
    )
    fn = getattr(kda, op)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*padded.tensors(), **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = fn(*padded.tensors(), **kw)
    cu.copy_(wider)
    graph.replay()
    torch.cuda.synchronize()
    covered = [x[:, : T - 2] for x in padded.tensors()]
    want_o, want_ht = fn(*covered, **dict(kw, cu_seqlens=wider, cu_seqlens_cpu=wider.cpu()))
    torch.testing.assert_close(o[:, : T - 2], want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ht, want_ht, rtol=1e-5, atol=1e-6)
