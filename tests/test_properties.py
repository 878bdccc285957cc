"""Properties every backend must have: varlen, carried state, layouts, GVA, strict causality.

Run on the torch backend and on the Triton kernels (under the interpreter on CPU).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda
from helpers import DEVICE, make_case, rel

BACKENDS = ["torch", "triton"]
GATES = ("precomputed", "lower_bound", "softplus")
TOL = 2e-5  # float32 inputs; both sides run in float32


def run(case, backend, **over):
    return kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs(**over))


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    lens=st.lists(st.integers(0, 37), min_size=1, max_size=4), gate=st.sampled_from(GATES), seed=st.integers(0, 9999)
)
def test_varlen_equals_one_by_one(backend, lens, gate, seed):
    case = make_case(seq_lens=lens, H=1, HV=2, K=16, V=16, gate=gate, device=DEVICE, seed=seed)
    o, ht = run(case, backend)
    offsets = case.cu_seqlens.tolist()
    for n in range(len(lens)):
        s, e = offsets[n], offsets[n + 1]
        one = dict(cu_seqlens=None, initial_state=case.initial_state[n : n + 1])
        sub = type(case)(**{**case.__dict__, "cu_seqlens": None})
        sub.q, sub.k, sub.v, sub.g, sub.beta = (x[:, s:e] for x in case.tensors())
        o_n, ht_n = run(sub, backend, **one)
        if e > s:
            assert rel(o[:, s:e], o_n) <= TOL
        assert rel(ht[n : n + 1], ht_n) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
@given(T=st.integers(2, 50), data=st.data(), gate=st.sampled_from(GATES), seed=st.integers(0, 9999))
def test_carried_state_equals_whole(backend, T, data, gate, seed):
    t = data.draw(st.integers(1, T - 1))
    case = make_case(T=T, B=2, H=2, K=16, V=8, gate=gate, device=DEVICE, seed=seed)
    o, ht = run(case, backend)
    first = type(case)(**case.__dict__)
    first.q, first.k, first.v, first.g, first.beta = (x[:, :t] for x in case.tensors())
    o1, h1 = run(first, backend)
    second = type(case)(**case.__dict__)
    second.q, second.k, second.v, second.g, second.beta = (x[:, t:] for x in case.tensors())
    o2, h2 = run(second, backend, initial_state=h1)
    assert rel(torch.cat([o1, o2], 1), o) <= TOL
    assert rel(h2, ht) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_layouts_agree(backend):
    case = make_case(T=40, B=2, H=2, K=16, V=32, device=DEVICE, seed=3)
    o_kv, h_kv = run(case, backend)
    o_vk, h_vk = run(case, backend, state_v_first=True, initial_state=case.initial_state.transpose(-1, -2).contiguous())
    assert rel(o_vk, o_kv) <= TOL
    assert rel(h_vk.transpose(-1, -2), h_kv) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_gva_equals_repeated_heads(backend):
    case = make_case(T=35, H=2, HV=4, K=16, V=16, gate="softplus", device=DEVICE, seed=4)
    o, ht = run(case, backend)
    rep = type(case)(**case.__dict__)
    rep.q, rep.k = (x.repeat_interleave(2, dim=2) for x in (case.q, case.k))
    o_rep, ht_rep = run(rep, backend)
    assert rel(o, o_rep) <= TOL and rel(ht, ht_rep) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
@given(T=st.integers(2, 40), data=st.data(), gate=st.sampled_from(GATES), seed=st.integers(0, 9999))
def test_strict_causality(backend, T, data, gate, seed):
    """Outputs before t are bit-identical when anything at or after t changes (also inside
    a partial last chunk)."""
    t = data.draw(st.integers(1, T - 1))
    case = make_case(T=T, H=1, HV=2, K=16, V=16, gate=gate, device=DEVICE, seed=seed, steep_steps=1)
    o, _ = run(case, backend)
    changed = type(case)(**case.__dict__)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = []
    for x in case.tensors():
        y = x.clone()
        noise = torch.randn(y[:, t:].shape, generator=gen).to(y.device, y.dtype)
        y[:, t:] = noise * (0.5 if x is case.g else 3.0) - (1.0 if x is case.g and case.gate == "precomputed" else 0)
        tensors.append(y)
    changed.q, changed.k, changed.v, changed.g, changed.beta = tensors
    o2, _ = run(changed, backend)
    assert torch.equal(o[:, :t], o2[:, :t]), "an output before t changed"
    assert not torch.equal(o[:, t:], o2[:, t:]), "the perturbation did not reach the outputs at t"
