"""Calls with grad on the CUDA backend with its launch stood in for by Triton's forward (which
writes the same checkpoints), on the CPU under the interpreter and on a GPU with CUDA tensors;
the rest of the path is real (the routing, the feature refusals, the custom op and its fake,
torch.compile, the misaligned fallback). The kernels themselves: tests/test_backward.py and the
GPU tests at the end of this file."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

import kda
import kda.cuda
from helpers import (
    DEVICE,
    assert_bands_untouched,
    assert_checkpoints_close,
    cuda_ready,
    gradients,
    guarded,
    make_case,
    rel,
)
from kda.api import checked_problem
from kda.cuda import BACKEND

REAL_REJECTS = type(BACKEND).rejects


def cpu_rejects(self, p):
    """The real checks with the dtype / head-dim / device ones answered as on an H200: the
    features after them (GVA, softplus, g dtype, pools with grad) still refuse."""
    fake = dataclasses.replace(p, q=p.q.to(torch.bfloat16), K=128, V=128)
    reason = REAL_REJECTS(self, fake)
    return None if reason == "tensors on cpu (needs CUDA tensors)" else reason


@pytest.fixture
def cuda_stand_in():
    calls = []

    def stand_in(p, checkpoints=None):
        from kda.triton import chunk_forward

        calls.append(None if checkpoints is None else (tuple(checkpoints.shape), checkpoints.dtype))
        return chunk_forward(p, checkpoints=checkpoints)

    torch._dynamo.reset()
    with (  # (the backward's CUDA reverse chain has no stand-in: it stays on Triton here)
        mock.patch.object(kda.cuda, "BACKWARD_CHAIN", False),
        mock.patch.object(type(BACKEND), "availability", lambda self: None),
        mock.patch.object(type(BACKEND), "rejects", cpu_rejects),
        mock.patch("kda.cuda.forward.chunk_forward", stand_in),
    ):
        yield calls


@pytest.mark.parametrize("recurrent", [False, True])
def test_grad_call_on_cuda_saves_checkpoints_and_matches_triton(cuda_stand_in, recurrent):
    from kda.tables import checkpoint_rows

    case = make_case(seq_lens=[40, 1, 0, 17], H=2, K=16, V=16, seed=3, device=DEVICE)
    want = gradients(case, "triton", recurrent=recurrent)
    with kda.record_dispatch() as events:
        got = gradients(case, "cuda", recurrent=recurrent)
    op = "fused_recurrent_kda" if recurrent else "chunk_kda"
    assert events[0] == f"{op} -> cuda (forward on cuda with checkpoints, backward on triton)", events
    assert "chunk_kda backward -> triton" in events, events
    rows = checkpoint_rows(1, 58, 4, True)
    assert cuda_stand_in == [((rows, 2, 16, 16), torch.float32)], cuda_stand_in
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_backward_asks_for_the_cuda_chain_only_after_a_cuda_forward(cuda_stand_in):
    """The custom op carries where the forward ran into the backward: after the (stood-in) CUDA
    forward the backward asks whether its reverse chain may run on CUDA; after a Triton forward
    it says no without asking the backend; KDA_CUDA_BACKWARD_CHAIN=0 says no too."""
    import kda.triton.training as training

    asked = []
    real = training.cuda_chain_refusal

    def spy(p, do, dht, cuda_forward=False):
        asked.append(cuda_forward)
        return "spied"  # the chain's kernels have no stand-in: Triton's run

    case = make_case(seq_lens=[20, 3], H=2, K=16, V=16, seed=8, device=DEVICE)
    with mock.patch.object(training, "cuda_chain_refusal", spy):
        gradients(case, "cuda")
        gradients(case, "triton")
    assert asked == [True, False], asked
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    assert real(p, case.v, None) == "the forward ran on Triton"  # (the default: a caller must say)
    with mock.patch.object(kda.cuda, "BACKWARD_CHAIN", False):
        assert real(p, case.v, None, cuda_forward=True) == "KDA_CUDA_BACKWARD_CHAIN=0"
    with mock.patch.object(kda.cuda, "BACKWARD_CHAIN", True):  # then the backend's own checks (as on an H200 here)
        got = real(p, case.v.to(torch.float16), None, cuda_forward=True)
        assert got == "do is torch.float16 (the chain reads bf16)", got


def test_grad_calls_cuda_cannot_run_are_still_refused(cuda_stand_in):
    gva = make_case(T=20, H=1, HV=2, K=16, V=16, seed=4, device=DEVICE)
    with pytest.raises(kda.BackendUnavailableError, match="grouped value heads"):
        gradients(gva, "cuda")
    with pytest.raises(kda.BackendUnavailableError, match="grouped value heads"):
        gradients(gva, "cuda", recurrent=True)
    soft = make_case(T=20, H=1, K=16, V=16, gate="softplus", seed=5, device=DEVICE)
    with pytest.raises(kda.BackendUnavailableError, match="softplus"):
        gradients(soft, "cuda")
    assert cuda_stand_in == []


def test_short_decode_shaped_grad_call_with_gva_never_reaches_k1_k2(cuda_stand_in):
    """A decode shape (1 token a sequence) with grad and HV != H: prefers_decode is False with
    grad, so the GVA refusal must still hold."""
    gva = make_case(seq_lens=[1, 1, 1], H=1, HV=2, K=16, V=16, seed=6, device=DEVICE)
    with pytest.raises(kda.BackendUnavailableError, match="grouped value heads"):
        gradients(gva, "cuda", recurrent=True)


def compiled_grads(case, leaves_q=None, fullgraph=True):
    names = ("q", "k", "v", "g", "beta")
    leaves = [getattr(case, n).detach().clone().requires_grad_() for n in names]
    if leaves_q is not None:
        leaves[0] = leaves_q
    kw = case.kwargs()
    if case.cu_seqlens is not None:
        kw["cu_seqlens_cpu"] = case.cu_seqlens.cpu()
    torch._dynamo.reset()
    fn = torch.compile(lambda *t: kda.chunk_kda(*t, backend="cuda", **kw), fullgraph=fullgraph)
    o, ht = fn(*leaves)
    (o.float().square().sum() + ht.square().sum()).backward()
    return [x.grad for x in leaves]


def test_compile_fullgraph_with_grad_on_cuda(cuda_stand_in):
    case = make_case(B=2, T=40, H=2, K=16, V=16, seed=7, device=DEVICE)  # batched: CPU cu_seqlens do not trace
    with kda.record_dispatch() as events:
        got = compiled_grads(case)
    assert cuda_stand_in and cuda_stand_in[0] is not None, cuda_stand_in
    assert "chunk_kda backward -> triton" in events, events
    names = ("q", "k", "v", "g", "beta")
    leaves = [getattr(case, n).detach().clone().requires_grad_() for n in names]
    o, ht = kda.chunk_kda(*leaves, backend="triton", **case.kwargs())  # eager
    (o.float().square().sum() + ht.square().sum()).backward()
    for a, b, n in zip(got, [x.grad for x in leaves], names):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), n


def test_opcheck_chunk_fwd_use_cuda_with_checkpoints(cuda_stand_in):
    """The fake's shapes against the CUDA branch's (checkpoints when use_cuda and save)."""
    from kda.api import checked_problem
    from kda.autograd import _problem_args, chunk_fwd

    case = make_case(seq_lens=[40, 0, 17], H=2, K=16, V=16, seed=8, device=DEVICE)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    torch.library.opcheck(chunk_fwd, (*_problem_args(p), True, True),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_misaligned_under_compile_falls_back_with_a_note(cuda_stand_in):
    case = make_case(T=20, H=1, K=16, V=16, seed=9, device=DEVICE)
    big = torch.randn(case.q.numel() + 1, device=DEVICE)
    q = big[1:].view_as(case.q).detach()
    q.copy_(case.q)
    q.requires_grad_()
    assert q.data_ptr() % 16
    with kda.record_dispatch() as events:
        compiled_grads(case, leaves_q=q)
    assert any(e.startswith("cuda refused: `q` is not 16-byte aligned") for e in events), events
    assert cuda_stand_in == [], cuda_stand_in


# ---- on the GPU: K2's checkpoints and the training forward on the real kernels


def _checkpoints_both_ways(p):
    from kda.cuda.forward import chunk_forward as cuda_chunk_forward
    from kda.tables import chunk_tables
    from kda.triton.training import checkpoint_shape, train_forward

    rows = chunk_tables(p).checkpoint_offsets[-1].item()
    # NaN bands past both ends: the batched cases' rows are all real, so a check of the rows past
    # them alone looked at nothing there (2026-12-06)
    buf, ours, guard = guarded(checkpoint_shape(p), torch.float32, "cuda")
    cuda_chunk_forward(p, ours)
    assert_bands_untouched(buf, guard, "the checkpoints")
    _, _, theirs = train_forward(p)
    return rows, ours, theirs


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("warps", ["1", "2", "4", "2k2"])
@pytest.mark.parametrize("shape", ["varlen", "batched"])
@pytest.mark.parametrize("h0", ["fp32", "bf16", None])
def test_gpu_cuda_checkpoints_every_width_layout_and_state(monkeypatch, warps, shape, h0):
    """Every CTA width (v_warp / kSlices differ), batched tables (the cached builder) as well as
    varlen, no / bf16 initial state; compared row by row so one bad row is not averaged away."""
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", warps)
    kw = dict(seq_lens=[130, 1, 0, 64, 200]) if shape == "varlen" else dict(B=3, T=200)
    case = make_case(**kw, H=3, K=128, V=128, dtype=torch.bfloat16, device="cuda", with_state=h0 is not None,
                     seed=17)  # fmt: skip
    if h0 == "bf16":
        case.initial_state = case.initial_state.to(torch.bfloat16)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    rows, ours, theirs = _checkpoints_both_ways(p)
    assert ours[:rows].isfinite().all() and ours[rows:].isnan().all()
    assert_checkpoints_close(ours, theirs, rows)


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_checkpoints_past_2_31_elements():
    """Sequences whose checkpoint rows start past 2^31 float elements (rows * H * 128 * 128):
    four of 64k tokens (exactly 1024 rows each, a multiple of 4 chunks) put the next at
    4096 * 32 * 16384 = 2^31. About 30 GB on the device."""
    case = make_case(seq_lens=[65536] * 4 + [1, 130], H=32, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                     seed=18)  # fmt: skip
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    rows, ours, theirs = _checkpoints_both_ways(p)
    assert rows == 4 * 1024 + 1 + 3
    assert ours[:rows].isfinite().all() and ours[rows:].isnan().all()
    for r in (0, 1023, 1024, 4095, 4096, 4097, 4098, 4099):
        assert rel(ours[r], theirs[r]) < 1e-2, r


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_fused_recurrent_and_bf16_states_train_forward_on_cuda():
    case = make_case(seq_lens=[300, 17, 129], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=19)
    case.initial_state = case.initial_state.to(torch.bfloat16)
    for recurrent in (False, True):
        want = gradients(case, "triton", recurrent=recurrent, final_state_dtype=torch.bfloat16)
        with kda.record_dispatch() as events:
            got = gradients(case, "cuda", recurrent=recurrent, final_state_dtype=torch.bfloat16)
        assert "cuda:recurrence" in events and "chunk_kda backward -> triton" in events, events
        for name in want:
            assert rel(got[name], want[name]) < 2e-2, (recurrent, name, rel(got[name], want[name]))


@pytest.mark.gpu
@cuda_ready
def test_gpu_compile_fullgraph_with_grad_runs_the_cuda_forward():
    import torch._dynamo

    case = make_case(B=2, T=300, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=20)
    names = ("q", "k", "v", "g", "beta")

    def grads(fn):
        leaves = [getattr(case, n).detach().clone().requires_grad_() for n in names]
        o, ht = fn(*leaves)
        (o.float().square().sum() + ht.square().sum()).backward()
        return [x.grad for x in leaves]

    want = grads(lambda *t: kda.chunk_kda(*t, backend="triton", **case.kwargs()))
    torch._dynamo.reset()
    with kda.record_dispatch() as events:
        got = grads(torch.compile(lambda *t: kda.chunk_kda(*t, **case.kwargs()), fullgraph=True))
    assert "cuda:recurrence" in events and "chunk_kda backward -> triton" in events, events
    for a, b, n in zip(got, want, names):
        assert rel(a, b) < 2e-2, n


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("gate_shift", [0.0, -6.0])
def test_gpu_cuda_state_grad_chain_against_triton_and_fp64(layout, gate_shift):
    """kda.cuda.training.state_grad_chain (K1's workspace, recurrence.cu's chain) beside Triton's
    chain on the same bf16 inputs: every real chunk's dS written (NaN poison; spare table slots
    untouched) and close to Triton's; the initial state's gradient (an empty and a one-token
    sequence among others) against fp64 autograd of the token loop within 10% of Triton's error.
    The raw gate as drawn decays the state by about exp(-40) a chunk; lowered by 6 (gate_shift)
    it carries dS across chunks, so that gamma's part of the step shows too."""
    from helpers import fp64_gradients
    from kda.cuda.training import dstates_row_major
    from kda.cuda.training import state_grad_chain as cuda_chain
    from kda.tables import chunk_tables
    from kda.triton.prepare import prepare_chunks
    from kda.triton.state_grad import state_grad_chain as triton_chain

    case = make_case(seq_lens=[300, 1, 0, 129], H=3, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                     state_v_first=layout, seed=21)  # fmt: skip
    case.g = case.g + gate_shift
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    gen = torch.Generator().manual_seed(0)  # helpers.gradients' draws: fp64_gradients uses the same dO, dht
    do = torch.randn(p.v.shape, generator=gen, dtype=torch.float64).to("cuda", torch.bfloat16)
    dht = torch.randn(p.state_shape, generator=gen, dtype=torch.float64).to("cuda", torch.float32)
    tables = chunk_tables(p)
    real = int(tables.chunk_offsets[-1])
    shape = (tables.num_chunks, p.H, p.V, p.K)
    ours = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    dh0 = torch.full(p.state_shape, float("nan"), device="cuda")
    with kda.record_dispatch() as events:
        cuda_chain(p, do, dht, dh0, ours)
    assert events[-2:] == ["cuda:prepare", "cuda:state_grad_chain"], events
    theirs = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    dh0_t = torch.empty_like(dh0)
    triton_chain(p, tables, prepare_chunks(p, tables, torch.bfloat16, "tf32"), do, dht, dh0_t, theirs, True, "tf32")
    ours = dstates_row_major(ours)  # (rows swizzled as K1's tiles, for the state products' reads)
    assert ours[:real].isfinite().all(), "a chunk's state gradient was never written"
    assert ours[real:].isnan().all(), "a write landed past the real chunks"
    for c in range(real):  # chunk by chunk, so that one bad chunk is not averaged away
        assert rel(ours[c].float(), theirs[c].float()) < 2e-2, (c, rel(ours[c].float(), theirs[c].float()))
    ref = fp64_gradients(case)["initial_state"].to("cuda")
    for n in range(ref.shape[0]):  # sequence by sequence: the empty one's dh0 = dht would outweigh the rest
        ours_err, triton_err = rel(dh0[n], ref[n]), rel(dh0_t[n], ref[n])
        assert ours_err <= 1.1 * triton_err + 1e-4, (n, ours_err, triton_err)


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_backward_chain_switch_trains(monkeypatch):
    """KDA_CUDA_BACKWARD_CHAIN=0: after a CUDA forward the backward runs the Triton prepare stage
    and chain (not K1 and the CUDA chain), and every gradient against fp64 is within 10% of the
    Triton-only path's error (tests/test_backward.py has the default, the CUDA chain)."""
    monkeypatch.setattr(kda.cuda, "BACKWARD_CHAIN", False)
    case = make_case(seq_lens=[300, 17, 129], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=22)
    ref = gradients(case.to(torch.float64), "torch")
    triton_only = gradients(case, "triton")
    with kda.record_dispatch() as events:
        ours = gradients(case, "cuda")
    assert "triton:prepare_chunks" in events and "triton:state_grad_chain" in events, events
    assert "cuda:state_grad_chain" not in events and events.count("cuda:prepare") == 1, events
    for name in ref:
        ours_err, triton_err = rel(ours[name], ref[name]), rel(triton_only[name], ref[name])
        assert ours_err <= 1.1 * triton_err + 1e-4, f"d{name}: cuda forward {ours_err:.3e} vs triton {triton_err:.3e}"


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("gate_shift", [0.0, -6.0])
@pytest.mark.parametrize("batched", [False, True])
def test_gpu_cuda_state_products_against_triton(layout, gate_shift, batched):
    """kda.cuda.training.state_products beside the Triton state and dU kernels on the same K1
    workspace, checkpoints (the CUDA training forward's) and chain dS: every real chunk's
    scratch and every token's dv written (NaN poison), nothing past the real chunks, and each
    product close to Triton's chunk by chunk, dv token by token; the same bits from a grid of 1
    and 3 CTAs. Sequences of 300, 1, 0, 129 and 64 tokens: spans of four chunks and shorter
    ones, a last chunk of one token, an empty sequence; or batched, 3 x 200 tokens."""
    from kda.cuda.forward import chunk_forward
    from kda.cuda.training import k1_operands, product_scratch_numel, state_products
    from kda.cuda.training import state_grad_chain as cuda_chain
    from kda.tables import chunk_tables
    from kda.triton.chunk_grad import scratch_views
    from kda.triton.chunk_grad import state_products as triton_products
    from kda.triton.training import checkpoint_shape

    shape = dict(B=3, T=200) if batched else dict(seq_lens=[300, 1, 0, 129, 64])
    case = make_case(**shape, H=3, K=128, V=128, dtype=torch.bfloat16, device="cuda", state_v_first=layout, seed=23)
    case.g = case.g + gate_shift
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    tables = chunk_tables(p)
    NC, H, real = tables.num_chunks, p.H, int(tables.chunk_offsets[-1])
    checkpoints = torch.full(checkpoint_shape(p), float("nan"), device="cuda")
    chunk_forward(p, checkpoints=checkpoints)
    do = torch.randn(p.v.shape, device="cuda").to(torch.bfloat16)
    dht = torch.randn(p.state_shape, device="cuda")
    dstates = torch.empty(NC, H, p.V, p.K, dtype=torch.bfloat16, device="cuda")
    workspace = cuda_chain(p, do, dht, None, dstates, tables)
    results = []
    for cuda in (True, False):  # (NaN bands: the batched case has no chunk slot past the real ones)
        buf, scratch, guard = guarded((product_scratch_numel(NC, H),), torch.float32, "cuda")
        dv = torch.full_like(p.v, float("nan"))
        with kda.record_dispatch() as events:
            if cuda:
                state_products(p, do, checkpoints, dstates, workspace, tables, scratch, dv)
            else:
                triton_products(p, tables, k1_operands(workspace), do, checkpoints, dstates, True, "tf32", True,
                                scratch, dv)  # fmt: skip
        assert events == (["cuda:state_products"] if cuda else []), events
        assert_bands_untouched(buf, guard, "the scratch")
        results.append((scratch_views(scratch, NC, H, 128), dv))
    (ours, dv_ours), (theirs, dv_theirs) = results

    def chunks(x, lo, hi):  # chunk slots lo..hi of a scratch view, chunk first
        return x[:, lo:hi].transpose(0, 1) if x.dim() == 5 else x[lo:hi]

    names = ("dQ~, dw, dK^", "dU V^T, dO V^T", "dgamma")
    for name, a, b in zip(names, ours, theirs):
        assert chunks(a, 0, real).isfinite().all(), f"{name}: a real chunk's value was never written"
        assert chunks(a, real, NC).isnan().all(), f"{name}: a write past the real chunks"
        for c, (x, y) in enumerate(zip(chunks(a, 0, real), chunks(b, 0, real))):  # one bad chunk is not averaged away
            for i, (xi, yi) in enumerate(zip(x, y) if a.dim() == 5 else [(x, y)]):
                assert rel(xi, yi) < 2e-2, (name, i, c, rel(xi, yi))
    assert dv_ours.isfinite().all(), "a token's dv was never written"
    dv_err = rel(dv_ours.float(), dv_theirs.float())
    # Few CTAs, each taking many (checkpoint row, head) items in turn, its pipeline running across
    # them: the same bits as a CTA an SM (where this case has fewer items than SMs, one item each).
    import kda.cuda.training as cuda_training

    for ctas in (1, 3):
        scratch = torch.full((product_scratch_numel(NC, H),), float("nan"), device="cuda")
        dv = torch.full_like(p.v, float("nan"))
        with mock.patch.object(cuda_training, "sm_count", lambda index: ctas):
            state_products(p, do, checkpoints, dstates, workspace, tables, scratch, dv)
        few = scratch_views(scratch, NC, H, 128)
        assert all(torch.equal(chunks(a, 0, real), chunks(b, 0, real)) for a, b in zip(few, ours)), ctas
        assert torch.equal(dv, dv_ours), ctas
    errors = [f"{rel(chunks(a, 0, real), chunks(b, 0, real)):.2e}" for a, b in zip(ours, theirs)]
    print("rel to triton:", dict(zip(names, errors)), f"dv {dv_err:.2e}")
    assert dv_err < 1e-2, dv_err
    tokens_ours, tokens_theirs = dv_ours.float().flatten(0, 1), dv_theirs.float().flatten(0, 1)
    for t in range(tokens_ours.shape[0]):  # token by token
        assert rel(tokens_ours[t], tokens_theirs[t]) < 2e-2, (t, rel(tokens_ours[t], tokens_theirs[t]))


@pytest.mark.gpu
@cuda_ready
def test_gpu_cuda_state_products_switch(monkeypatch):
    """KDA_CUDA_STATE_PRODUCTS=0: the CUDA chain, then the Triton state kernels on K1's
    workspace; every gradient of the default path (the CUDA products) against fp64 within 25%
    of the switched-off path's, as tests/test_backward.py bounds the default path by the Triton
    one's: dA_log here is two numbers, a sum over every token and channel of a head, and moved
    by 15% between the two (H200, 2026-12-02, run 42) where dg, summed into it, got better."""
    case = make_case(seq_lens=[300, 17, 129], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=24)
    ref = gradients(case.to(torch.float64), "torch")
    with kda.record_dispatch() as events:
        default = gradients(case, "cuda")
    assert "cuda:state_products" in events, events
    monkeypatch.setattr(kda.cuda, "STATE_PRODUCTS", False)
    with kda.record_dispatch() as events:
        switched = gradients(case, "cuda")
    assert "cuda:state_grad_chain" in events and "cuda:state_products" not in events, events
    for name in ref:
        ours, off = rel(default[name], ref[name]), rel(switched[name], ref[name])
        print(f"d{name}: cuda products {ours:.3e}, triton products {off:.3e}")
        assert ours <= 1.25 * off + 1e-4, (name, ours, off)
