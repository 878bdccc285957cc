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


def test_automatic_split_rule_on_the_measured_cases():
    """``segments.auto_span`` on the H200 cases it was set from (132 SMs; kda bench --long,
    runs 18 and 50): 1x2097152 H8 split, 1x524288 H16 and the H32 cases not."""
    from kda import segments

    L = segments.AUTO_SEGMENT_TOKENS
    assert segments.auto_span([2097152], 8, 132) == L
    assert segments.auto_span([524288], 16, 132) == 0
    assert segments.auto_span([131072], 32, 132) == 0 and segments.auto_span([32768], 32, 132) == 0
    long = segments.AUTO_MIN_SEGMENTS * L
    assert segments.auto_span([long - 16], 1, 132) == 0  # short of AUTO_MIN_SEGMENTS segments
    assert segments.auto_span([300] * 500 + [long], 8, 132) == L  # one long sequence among short ones
    assert segments.auto_span([long, long], 8, 132) == 0  # 16 chains: the uncut call fills enough SMs
    assert segments.auto_span([long, long], 8, 264) == L  # a GPU of twice the SMs
    assert segments.auto_span([], 8, 132) == 0


def test_setting_unset_is_automatic_zero_is_off(monkeypatch):
    from kda import segments

    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    assert segments.segment_tokens() is None
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "0")
    assert segments.segment_tokens() == 0
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "4096")
    assert segments.segment_tokens() == 4096


def test_no_automatic_split_off_the_cuda_path(monkeypatch):
    """The automatic split was measured on the CUDA path only: CPU tensors, and Triton or torch
    asked for by name, are never split unless KDA_SEGMENT_TOKENS asks."""
    from kda import segments

    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    monkeypatch.setattr(segments, "AUTO_SEGMENT_TOKENS", 32)
    monkeypatch.setattr(segments, "AUTO_MIN_SEGMENTS", 2)
    case = make_case(T=96, H=1, K=16, V=8, device=DEVICE, seed=85)
    for backend in ("torch", "triton"):
        with kda.record_dispatch() as events:
            kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
        assert not any(e.startswith("segments") for e in events), (backend, events)


@pytest.mark.gpu
def test_gpu_automatic_split_runs_where_chains_are_few(monkeypatch):
    """A call the CUDA path runs, one long sequence and one head: split automatically (at the
    real constants, 8 segments of 16384 tokens; and at small ones), said in the dispatch
    events, with the uncut call's results; KDA_SEGMENT_TOKENS=0 keeps it uncut."""
    import torch

    from helpers import cuda_ready
    from kda import segments

    if cuda_ready.args[0]:
        pytest.skip(cuda_ready.kwargs["reason"])
    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    L = segments.AUTO_SEGMENT_TOKENS
    for span, T in ((L, segments.AUTO_MIN_SEGMENTS * L + 80), (64, 64 * segments.AUTO_MIN_SEGMENTS + 40)):
        monkeypatch.setattr(segments, "AUTO_SEGMENT_TOKENS", span)
        case = make_case(T=T, H=1, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=86)
        case.g = case.g - 6.0  # long memory: a segment's entering state carries through it
        with kda.record_dispatch() as events:
            got = kda.chunk_kda(*case.tensors(), **case.kwargs())
        assert f"segments:{span}" in events and any(e.startswith("cuda:") for e in events), events
        monkeypatch.setenv("KDA_SEGMENT_TOKENS", "0")
        with kda.record_dispatch() as events:
            want = kda.chunk_kda(*case.tensors(), **case.kwargs())
        monkeypatch.delenv("KDA_SEGMENT_TOKENS")
        assert not any(e.startswith("segments") for e in events), events
        # two bf16-input computations of the same function: each about 3e-3 from fp64
        moved = (rel(got[0], want[0]), rel(got[1], want[1]))
        assert max(moved) <= 1e-2, moved
