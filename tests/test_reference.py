"""The two torch forms of the spec agree in float64: chunk-16 == token-by-token."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import make_case, rel
from kda import reference

GATES = ("precomputed", "lower_bound", "softplus")


def activated(c):
    """``(q, k, g, beta)`` of a case as the API's in-kernel options would make them."""
    return reference.activate_inputs(
        c.q, c.k, c.g, c.beta,
        use_qk_l2norm=True, use_gate=c.gate != "precomputed", use_beta_sigmoid=True,
        A_log=c.A_log, dt_bias=None if c.dt_bias is None else c.dt_bias.view(c.v.shape[2], -1),
        lower_bound=-5.0 if c.gate == "lower_bound" else None,
    )  # fmt: skip


def both_forms(case, **kw):
    c = case.to(torch.float64)
    q, k, g, beta = activated(c)
    h0 = c.initial_state
    args = dict(scale=0.3, initial_state=h0, output_final_state=True, cu_seqlens=c.cu_seqlens)
    return (
        reference.naive_recurrent_kda(q, k, c.v, g, beta, **args),
        reference.chunk16_kda(q, k, c.v, g, beta, **args),
    )


@given(
    T=st.integers(1, 70),
    B=st.integers(1, 2),
    H=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    K=st.sampled_from([4, 7, 16]),
    V=st.sampled_from([3, 8, 16]),
    gate=st.sampled_from(GATES),
    steep=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunk16_equals_recurrent(T, B, H, group, K, V, gate, steep, seed):
    case = make_case(B=B, T=T, H=H, HV=H * group, K=K, V=V, gate=gate, steep_steps=steep, seed=seed)
    (o_r, s_r), (o_c, s_c) = both_forms(case)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel(o_c, o_r) <= 1e-10
    assert rel(s_c, s_r) <= 1e-10


@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    gate=st.sampled_from(GATES),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunk16_equals_recurrent_varlen(lens, gate, seed):
    case = make_case(seq_lens=lens + [1, 0], H=2, HV=4, K=8, V=8, gate=gate, steep_steps=2, seed=seed)
    (o_r, s_r), (o_c, s_c) = both_forms(case)
    assert rel(o_c, o_r) <= 1e-10
    assert rel(s_c, s_r) <= 1e-10


def test_steep_softplus_gate_is_finite_and_exact():
    """Per-step log-decay down to -50 and beyond: no inf, no NaN, both forms agree."""
    case = make_case(T=48, K=16, V=8, gate="softplus", steep_steps=6, seed=1)
    (o_r, s_r), (o_c, s_c) = both_forms(case)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel(o_c, o_r) <= 1e-10 and rel(s_c, s_r) <= 1e-10


def test_inverse_is_exact():
    A = torch.randn(3, 16, 16, dtype=torch.float64).tril(-1) * 0.3
    inv = reference.unit_lower_inverse(A)
    eye = torch.eye(16, dtype=torch.float64)
    assert (inv @ (eye + A) - eye).abs().max() < 1e-12


def test_gates_and_l2norm():
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    n = reference.l2norm(x)
    assert torch.allclose(n.norm(dim=-1), x.norm(dim=-1) / (x.norm(dim=-1) ** 2 + 1e-6).sqrt())
    A_log, bias = torch.rand(3, dtype=torch.float64), torch.rand(3, 8, dtype=torch.float64)
    lb = reference.gate_lower_bound(x, A_log, bias, -5.0)
    assert ((lb >= -5.0) & (lb < 0)).all()
    assert torch.allclose(lb, -5.0 * torch.sigmoid(A_log.exp()[:, None] * (x + bias)))
    sp = reference.gate_softplus(x, A_log, bias)
    assert torch.allclose(sp, -A_log.exp()[:, None] * torch.log1p((x + bias).exp()))
    assert torch.allclose(reference.beta_from_logits(x, True), 2 * torch.sigmoid(x))


@pytest.mark.parametrize("steep", [False, True])
def test_chunk_backward_equals_autograd_of_the_token_loop(steep):
    """reference.chunk16_kda_backward (the stages the Triton backward runs) against float64
    autograd of the token loop: varlen with empty, one-token and partial chunks, GVA, a
    gradient into the final state, and per-step log-decays of -60 when steep."""
    torch.manual_seed(1)
    lens, H, HV, K, V = [5, 0, 33, 16, 1], 2, 4, 8, 6
    T, dt = sum(lens), torch.float64
    q, k = reference.l2norm(torch.randn(1, T, H, K, dtype=dt)), reference.l2norm(torch.randn(1, T, H, K, dtype=dt))
    v, beta = torch.randn(1, T, HV, V, dtype=dt), torch.rand(1, T, HV, dtype=dt)
    g = -torch.rand(1, T, HV, K, dtype=dt) * 1.5
    if steep:
        g[:, ::5, :, :3] = -60.0
    h0, dht = torch.randn(len(lens), HV, K, V, dtype=dt), torch.randn(len(lens), HV, K, V, dtype=dt)
    do = torch.randn(1, T, HV, V, dtype=dt)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = reference.naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = reference.chunk16_kda_backward(q, k, v, g, beta, do, initial_state=h0, dht=dht, cu_seqlens=cu)
    for name, got, leaf in zip(("q", "k", "v", "g", "beta", "h0"), grads, leaves):
        assert reference.relative_rms(got, leaf.grad) < 1e-12, name


RESETS = (float("-inf"), -1e30, -200.0, -104.5)  # each a hard reset (reference.HARD_RESET)


@pytest.mark.parametrize("value", RESETS)
def test_hard_resets_are_exact_in_the_chunk_form(value):
    """g = -inf (or any log-decay below HARD_RESET) zeroes its channel: the chunk form equals
    the token loop (where exp(-inf) = 0 is plain), finite, in float64, forward and backward.
    Resets at a chunk's first, a middle and its last row, two in one chunk, and a whole
    channel reset twice in a row."""
    torch.manual_seed(2)
    lens, H, K, V = [40, 7, 16], 1, 8, 6
    T, dt = sum(lens), torch.float64
    q, k = reference.l2norm(torch.randn(1, T, H, K, dtype=dt)), reference.l2norm(torch.randn(1, T, H, K, dtype=dt))
    v, beta = torch.randn(1, T, H, V, dtype=dt), torch.rand(1, T, H, dtype=dt)
    g = -torch.rand(1, T, H, K, dtype=dt)
    for t, channels in ((0, [0]), (5, [1, 2]), (9, [1]), (15, [3]), (16, [3]), (17, [0, 1, 2, 3, 4, 5, 6, 7]),
                        (44, [5]), (47, [2]), (62, [6])):  # fmt: skip
        g[0, t, 0, channels] = value
    h0, dht, do = (
        torch.randn(3, H, K, V, dtype=dt),
        torch.randn(3, H, K, V, dtype=dt),
        torch.randn(1, T, H, V, dtype=dt),
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_r, s_r = reference.naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                             cu_seqlens=cu)  # fmt: skip
    o_c, s_c = reference.chunk16_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel(o_c, o_r) <= 1e-12 and rel(s_c, s_r) <= 1e-12, (rel(o_c, o_r), rel(s_c, s_r))
    ((o_r * do).sum() + (s_r * dht).sum()).backward()
    grads = reference.chunk16_kda_backward(q, k, v, g, beta, do, initial_state=h0, dht=dht, cu_seqlens=cu)
    for name, got, leaf in zip(("q", "k", "v", "g", "beta", "h0"), grads, leaves):
        assert torch.isfinite(got).all() and torch.isfinite(leaf.grad).all(), name
        assert reference.relative_rms(got, leaf.grad) < 1e-12, name


@given(
    lens=st.lists(st.integers(0, 90), min_size=0, max_size=3),
    segment_chunks=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    two_pass=st.booleans(),
)
def test_segmented_chunk_form_equals_the_chunk_form(lens, segment_chunks, seed, two_pass):
    """Segments' affine transitions (P, R), chained at the boundaries, then each segment run from
    its true start (spec section 8), or its output formed from the transition runs' (two_pass,
    all segments batched): equal to the chunk form to float64 rounding. Mild decays
    (so that P carries the entering state far: with steep ones P vanishes and a wrong chain
    would go unseen), a 100-token sequence over several segments, varlen sequences shorter
    than a segment, partial last chunks, a hard reset."""
    case = make_case(seq_lens=[100, *lens, 1], H=2, HV=4, K=8, V=6, gate="precomputed", seed=seed)
    case.g = case.g * 0.02
    case.g[0, 20, 1, 3] = float("-inf")
    c = case.to(torch.float64)
    q, k = reference.l2norm(c.q), reference.l2norm(c.k)
    beta = torch.sigmoid(c.beta)
    args = dict(scale=0.3, initial_state=c.initial_state, output_final_state=True, cu_seqlens=c.cu_seqlens)
    o_c, s_c = reference.chunk16_kda(q, k, c.v, c.g, beta, **args)
    o_s, s_s = reference.segmented_chunk16_kda(
        q, k, c.v, c.g, beta, segment_chunks=segment_chunks, two_pass=two_pass, **args
    )
    assert rel(o_s, o_c) <= 1e-12 and rel(s_s, s_c) <= 1e-12, (rel(o_s, o_c), rel(s_s, s_c))


@given(
    lens=st.lists(st.integers(0, 80), min_size=0, max_size=3),
    gate=st.sampled_from(GATES),
    reset=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_paired_chunk_form_equals_the_chunk_form(lens, gate, reset, seed):
    """Two chunks a sequential step (docs/algorithm.md section 2b) against one: equal to float64
    rounding. Mild decays where the gate is precomputed (the pair's rescaled operands carry a's
    state into b; steep ones would hide a wrong coupling), sequences of an odd and an even chunk
    count, partial last chunks, one-token and empty sequences, a hard reset in a's or b's rows."""
    case = make_case(seq_lens=[70, 64, *lens, 1, 0], H=2, HV=4, K=8, V=6, gate=gate, steep_steps=1, seed=seed)
    if gate == "precomputed":
        case.g = case.g * 0.05
    c = case.to(torch.float64)
    q, k, g, beta = activated(c)
    if reset:  # on the activated gate: an activation would map a raw -inf to no decay at all
        g = g.clone()
        g[0, 20, 1, 3] = float("-inf")  # chunk 1 of the first sequence: b of its first pair
        g[0, 75, 2, 5] = float("-inf")  # chunk 0 of the second: a of its first pair
        assert (g < reference.HARD_RESET).sum() >= 2
    args = dict(scale=0.3, initial_state=c.initial_state, output_final_state=True, cu_seqlens=c.cu_seqlens)
    o_c, s_c = reference.chunk16_kda(q, k, c.v, g, beta, **args)
    o_p, s_p = reference.chunk16_kda(q, k, c.v, g, beta, pairs=True, **args)
    assert torch.isfinite(o_p).all() and torch.isfinite(s_p).all()
    assert rel(o_p, o_c) <= 1e-12 and rel(s_p, s_c) <= 1e-12, (rel(o_p, o_c), rel(s_p, s_c))


def test_pair_coupling_matters():
    """The pair step without its coupling (b's writes blind to a's) is measurably wrong, so the
    test above can fail: the coupling is not a term that rounds away."""
    torch.manual_seed(5)
    q, k = (reference.l2norm(torch.randn(2, 32, 8, dtype=torch.float64)) for _ in range(2))
    g = -0.05 * torch.rand(2, 32, 8, dtype=torch.float64)
    beta = torch.rand(2, 32, dtype=torch.float64)
    v, S = torch.randn(2, 32, 6, dtype=torch.float64), torch.randn(2, 8, 6, dtype=torch.float64)
    a, b = (reference.prepare_chunk(q[:, r], k[:, r], g[:, r], beta[:, r], 0.3) for r in (slice(0, 16), slice(16, 32)))
    O1, S1 = reference.recurrence_step(a, v[:, :16], S)
    O2, S2 = reference.recurrence_step(b, v[:, 16:], S1)
    ops = reference.pair_operands(a, b)
    O, S_next = reference.pair_step(ops, v, S)
    assert rel(O, torch.cat([O1, O2], -2)) <= 1e-13 and rel(S_next, S2) <= 1e-13
    ops.coupling = torch.zeros_like(ops.coupling)
    O_blind, S_blind = reference.pair_step(ops, v, S)
    assert rel(S_blind, S2) > 1e-3 and rel(O_blind, torch.cat([O1, O2], -2)) > 1e-3


def test_relative_rms_sums_over_slices_as_over_the_whole(monkeypatch):
    """relative_rms in slices of RMS_SLICE elements (bounded memory on 2M-token outputs) gives
    the whole-tensor float64 formula, with a tail slice shorter than the others, a non-contiguous
    operand and a broadcast one; a NaN in any slice but the first gives NaN; a zero reference gives
    the error's own norm."""
    monkeypatch.setattr(reference, "RMS_SLICE", 7)
    x = torch.randn(5, 4, 3, dtype=torch.float32).transpose(0, 2)  # 60 elements: 8 slices of 7 and one of 4
    ref = torch.randn(3, 4, 5, dtype=torch.bfloat16)
    whole = ((x.double() - ref.double()).norm() / ref.double().norm()).item()
    assert reference.relative_rms(x, ref) == pytest.approx(whole, rel=1e-12)
    row = torch.randn(5, dtype=torch.float64)
    broadcast = ((x.double() - row).norm() / row.expand(3, 4, 5).norm()).item()
    assert reference.relative_rms(x, row) == pytest.approx(broadcast, rel=1e-12)
    late = x.clone()
    late[2, 3, 4] = float("nan")  # the last element: the short tail slice
    assert math.isnan(reference.relative_rms(late, ref))
    assert reference.relative_rms(x, torch.zeros_like(x)) == pytest.approx(x.double().norm().item(), rel=1e-12)
