"""The segment split of long sequences (kda.segments, KDA_SEGMENT_TOKENS): the same outputs and
final states as the uncut call, on the torch backend and Triton (the interpreter on CPU)."""

from __future__ import annotations

import pytest

import kda
from helpers import AUTO, DEVICE, make_case, rel

BACKENDS = ("torch", AUTO)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [dict(B=2, T=100), dict(seq_lens=[70, 0, 5, 40, 33])], ids=["batched", "varlen"])
@pytest.mark.parametrize("layout", [False, True])
def test_split_equals_the_uncut_call(monkeypatch, backend, shape, layout):
    """32-token segments (two chunks): sequences over several segments, one shorter than a
    segment, an empty one, a partial last chunk; mild decays so that each segment's entering
    state matters; an initial state and the final state."""
    case = make_case(**shape, H=1, HV=2, K=16, V=8, gate="precomputed", state_v_first=layout, device=DEVICE, seed=81)
    case.g = case.g * 0.02
    kw = case.kwargs()
    want = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    with kda.record_dispatch() as events:
        got = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    assert "segments:32" in events, events
    assert rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5, (rel(got[0], want[0]), rel(got[1], want[1]))


def test_training_calls_and_short_sequences_are_not_split(monkeypatch):
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    case = make_case(T=32, H=1, K=16, V=8, seed=82)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
    assert not any(e.startswith("segments") for e in events)
    long = make_case(T=80, H=1, K=16, V=8, seed=83)
    q = long.q.clone().requires_grad_()
    with kda.record_dispatch() as events:
        kda.chunk_kda(q, *long.tensors()[1:], backend="torch", **long.kwargs())
    assert not any(e.startswith("segments") for e in events)


@pytest.mark.parametrize("value", ["17", "-16", "x"])
def test_bad_setting_says_so(monkeypatch, value):
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", value)
    case = make_case(T=20, H=1, K=16, V=8, seed=84)
    with pytest.raises(ValueError, match="KDA_SEGMENT_TOKENS"):
        kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
