"""kda beside fla-core 0.6.0 (CPU included): kda's outputs against fla's own naive reference,
and kda as a backend of fla's dispatcher (fla's own chunk_kda and decode entry point reach
kda after ``kda.register_fla_backend()``, fall through to fla where kda cannot take the call,
and ``FLA_KDA=0`` turns kda off)."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

import kda
from helpers import AUTO, DEVICE, cuda_ready, fla_itself, make_case, rel

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")


@pytest.fixture(scope="module")
def fla_kda():
    assert kda.register_fla_backend()
    assert kda.register_fla_backend(), "registering twice is a no-op"
    from fla.ops import kda as fla_kda

    return fla_kda


def fla_registry():
    from inspect import unwrap

    from fla import backends
    from fla.ops.kda import chunk

    return backends._function_registries[unwrap(chunk.chunk_kda)]


def fla_log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("fla")]


@pytest.mark.parametrize("backend", ["torch", AUTO])
def test_kda_equals_fla_naive_reference(backend):
    """fla's naive_recurrent_kda (float32 token loop, precomputed gate, KV state, batched) on the
    same inputs: GVA, an initial state, T not a multiple of 16."""
    from fla.ops.kda.naive import naive_recurrent_kda

    case = make_case(B=2, T=37, H=2, HV=4, K=16, V=24, gate="precomputed", device=DEVICE, seed=47)
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (case.q, case.k))
    beta = torch.sigmoid(case.beta)
    o_fla, ht_fla = naive_recurrent_kda(q, k, case.v, case.g, beta, initial_state=case.initial_state,
                                        output_final_state=True)  # fmt: skip
    o, ht = kda.chunk_kda(q, k, case.v, case.g, beta, initial_state=case.initial_state, output_final_state=True,
                          backend=backend)  # fmt: skip
    assert rel(o, o_fla) <= 1e-5 and rel(ht, ht_fla) <= 1e-5, (rel(o, o_fla), rel(ht, ht_fla))


def test_registered_once_in_fla_registries(fla_kda):
    from fla import backends

    assert [b.backend_type for b in fla_registry()._backends.values()].count("kda") == 1
    assert "kda" in backends._get_operation_registry("kda")._backends


def test_fla_chunk_kda_reaches_kda_on_cpu(fla_kda, caplog):
    """On CPU fla's chunk_kda (whose Triton kernels need a GPU) runs kda, with fla's log line."""
    case = make_case(seq_lens=[5, 0, 21], H=1, HV=2, K=16, V=16, seed=41)
    fla_registry()._logged.clear()
    with caplog.at_level(logging.INFO), kda.record_dispatch() as events:
        got = fla_kda.chunk_kda(*case.tensors(), **case.kwargs())
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert events[0] == "chunk_kda -> torch", events
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(line.startswith("[FLA Backend]") and line.endswith("chunk_kda -> kda") for line in fla_log_lines(caplog))


def test_fla_transpose_state_layout_warns_once_at_the_callers_line(fla_kda):
    """fla's deprecated ``transpose_state_layout`` through fla's chunk_kda to kda: one
    DeprecationWarning, pointing at the line that called fla (kda's verifier and its call each
    warned, both at kda's or fla's own files, until 2026-12-07), and the layout honoured."""
    case = make_case(B=1, T=19, H=1, HV=2, K=16, V=8, state_v_first=True, seed=43)
    kw = case.kwargs()
    kw["transpose_state_layout"] = kw.pop("state_v_first")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fla_kda.chunk_kda(*case.tensors(), **kw)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [(w.filename, str(w.message)) for w in deprecations] == [
        (__file__, "`transpose_state_layout` is deprecated; use `state_v_first`")
    ], [(w.filename, w.lineno, str(w.message)) for w in deprecations]
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fla_graph_mode_padded_buffer_reaches_kda(fla_kda):
    """fla's use_graph layout (offsets padded with empty sequences to max_num_seqs, a token buffer
    longer than they cover): kda's verifier refused it ("must end at T") and fla's kernel ran,
    until a review of 2026-12-07; now kda runs it, the rows past the end zero."""
    import dataclasses

    case = make_case(seq_lens=[5, 9, 0, 0], H=1, HV=2, K=16, V=16, seed=46)
    pad = {name: torch.cat([x, torch.randn(1, 4, *x.shape[2:])], dim=1) for name, x in
           zip(("q", "k", "v", "g", "beta"), case.tensors())}  # fmt: skip
    padded = dataclasses.replace(case, **pad)
    with kda.record_dispatch() as events:
        o, ht = fla_kda.chunk_kda(*padded.tensors(), **padded.kwargs(), use_graph=True, max_num_seqs=4)
    assert events and events[0] == "chunk_kda -> torch", events
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert torch.equal(o[:, :14], want[0]) and torch.equal(ht, want[1])
    assert (o[:, 14:] == 0).all()


def test_fla_training_call_reaches_kda(fla_kda):
    case = make_case(T=20, H=1, K=16, V=16, seed=42)
    q = case.q.clone().requires_grad_()
    with kda.record_dispatch() as events:
        o, _ = fla_kda.chunk_kda(q, *case.tensors()[1:], **case.kwargs())
        o.sum().backward()
    assert events[0] == "chunk_kda -> torch (forward and backward)", events
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"cp_context": SimpleNamespace(layout="zigzag", cu_seqlens=None)}, "cp_context with layout='zigzag'"),
        ({"return_intermediate_states": True}, "kda cannot take the call: `return_intermediate_states"),
    ],
)
def test_calls_kda_cannot_take_fall_through_to_fla_saying_why(fla_kda, caplog, over, reason):
    """fla's verifier protocol: the reason is logged once and fla's own implementation runs (it
    is stood in for here: on CPU it cannot run)."""
    case = make_case(T=20, H=1, K=16, V=16, seed=43)
    registry = fla_registry()
    registry._logged.clear()
    backend = registry._backends["kda"]
    accepted, why = backend.verify("chunk_kda", *case.tensors(), **case.kwargs(**over))
    assert not accepted and why.startswith(reason), why


def test_fla_kda_off_switch(fla_kda, monkeypatch):
    monkeypatch.setenv("FLA_KDA", "0")
    assert not fla_registry()._backends["kda"].is_enabled()
    monkeypatch.setenv("FLA_KDA", "1")
    assert fla_registry()._backends["kda"].is_enabled()


def test_fla_itself_turns_kda_off_and_fails_a_call_that_reached_kda(fla_kda, monkeypatch):
    """helpers.fla_itself, which the tests "beside fla" call fla through: inside it fla's
    dispatcher skips kda (registered here) and FlashKDA, whatever the environment said, and a
    call that reached kda anyway fails the block."""
    monkeypatch.setenv("FLA_KDA", "1")
    monkeypatch.setenv("FLA_FLASH_KDA", "1")
    backend = fla_registry()._backends["kda"]
    with fla_itself():
        assert not backend.is_enabled()
        assert os.environ["FLA_FLASH_KDA"] == "0"
    assert backend.is_enabled(), "the environment comes back after the block"
    case = make_case(T=20, H=1, K=16, V=16, seed=45)
    with pytest.raises(AssertionError, match="reached kda"), fla_itself():
        kda.chunk_kda(*case.tensors(), **case.kwargs())  # what fla ran when kda was on


def test_fla_decode_reaches_kda_on_cpu(fla_kda):
    """fla's fused_recurrent_kda (dispatched through fused_recurrent_kda_fwd) runs kda on CPU
    tensors, with fla's semantics (a returned final state)."""
    case = make_case(seq_lens=[1, 3, 2], H=1, K=16, V=16, seed=44)
    kw = case.kwargs()
    kw.pop("safe_gate", None)
    with kda.record_dispatch() as events:
        got = fla_kda.fused_recurrent_kda(*case.tensors(), **kw)
    want = kda.fused_recurrent_kda(*case.tensors(), **kw)
    assert events and events[0] == "fused_recurrent_kda -> torch", events
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_decode_in_place_final_state_pools_and_refusals(fla_kda):
    """The entry point's own contract: inplace_final_state writes the final state into the
    initial one (slot n, or the slots of ssm_state_indices: kda's pool path, equal to a kda
    pool call); ``out=`` and calls kda's checks refuse fall through, saying why."""
    from fla import backends

    case = make_case(seq_lens=[2, 3], H=1, K=16, V=16, seed=45)
    backend = backends._get_operation_registry("kda")._backends["kda"]
    kw = dict(A_log=case.A_log, dt_bias=case.dt_bias, initial_state=case.initial_state.clone(),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, cu_seqlens=case.cu_seqlens)  # fmt: skip
    h0 = kw["initial_state"]
    _, ht = backend.fused_recurrent_kda_fwd(case.q, case.k, case.v, case.g, case.beta, **kw)
    _, want = kda.fused_recurrent_kda(case.q, case.k, case.v, case.g, case.beta, output_final_state=True,
                                      **dict(kw, initial_state=case.initial_state))  # fmt: skip
    assert ht is h0 and torch.equal(h0, want)

    pool = torch.randn(4, *case.initial_state.shape[1:])
    slots = torch.tensor([3, 0], dtype=torch.int32)
    mine, before = pool.clone(), pool.clone()
    args = (case.q, case.k, case.v, case.g, case.beta)
    accepted, why = backend.verify("fused_recurrent_kda_fwd", *args, **dict(kw, initial_state=pool,
                                   ssm_state_indices=slots))  # fmt: skip
    assert accepted, why
    backend.fused_recurrent_kda_fwd(*args, **dict(kw, initial_state=pool, ssm_state_indices=slots))
    kda.fused_recurrent_kda(*args, **dict(kw, initial_state=mine, inplace_final_state=True, ssm_state_indices=slots))
    assert torch.equal(pool, mine)
    assert not torch.equal(pool[3], before[3]) and torch.equal(pool[[1, 2]], before[[1, 2]])
    bad_indices = torch.zeros(2, dtype=torch.float32)
    # Slot indices with the final states returned apart (not in place): fla starts sequence n from
    # initial_state[indices[n]], which kda's plain call would not (a review, 2026-12-04).
    no_inplace = dict(initial_state=pool, inplace_final_state=False, output_final_state=True)
    for over, says in (({"out": torch.zeros(1)}, "`out`"),
                       ({"ssm_state_indices": bad_indices}, "kda cannot take the call"),
                       (dict(no_inplace, ssm_state_indices=slots), "without `inplace_final_state`"),
                       (dict(no_inplace, num_accepted_tokens=torch.ones(2, dtype=torch.int32)),
                        "without `inplace_final_state`")):  # fmt: skip
        accepted, why = backend.verify("fused_recurrent_kda_fwd", *args, **dict(kw, **over))
        assert not accepted and says in why, why


def spy_offset_checks(monkeypatch) -> list[bool]:
    """For each check of a given ``cu_seqlens`` from here on: whether it came without a host copy
    (on a GPU, a copy to the host: a sync)."""
    from kda import validation

    seen = []
    check = validation._check_cu_seqlens

    def spy(cu_seqlens, cu_seqlens_cpu, *args, **kwargs):
        if cu_seqlens is not None:
            seen.append(cu_seqlens_cpu is None)
        return check(cu_seqlens, cu_seqlens_cpu, *args, **kwargs)

    monkeypatch.setattr(validation, "_check_cu_seqlens", spy)
    return seen


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
def test_a_varlen_call_through_fla_copies_cu_seqlens_to_the_host_once(fla_kda, monkeypatch, entry, offsets_dtype):
    """fla runs kda's verifier, which checks the call (copying a GPU ``cu_seqlens`` to the host),
    then kda's call: the call takes the verifier's host copy, so the offsets are copied once a
    call, not twice (a review, 2026-12-04); the results are kda's own call's."""
    case = make_case(seq_lens=[3, 1, 4], H=1, K=16, V=16, seed=47)
    kw = case.kwargs(cu_seqlens=case.cu_seqlens.to(offsets_dtype))
    if entry == "fused_recurrent_kda":
        kw.pop("safe_gate", None)
    seen = spy_offset_checks(monkeypatch)
    got = getattr(fla_kda, entry)(*case.tensors(), **kw)
    assert seen == [True, False], seen  # the verifier's check copied, the call's did not
    want = getattr(kda, entry)(*case.tensors(), **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_verifiers_host_copy_serves_only_that_tensor_unchanged(fla_kda, monkeypatch):
    """The host copy the decode verifier leaves is taken by a call on the same ``cu_seqlens``
    tensor, unchanged since, once: another tensor of the same values, the same one written in
    place, or a second call each check their own offsets."""
    from fla import backends

    backend = backends._get_operation_registry("kda")._backends["kda"]
    case = make_case(seq_lens=[2, 3], H=1, K=16, V=16, seed=48)
    args = (case.q, case.k, case.v, case.g, case.beta)
    cu = case.cu_seqlens
    seen = spy_offset_checks(monkeypatch)
    for call_cu, touch in ((cu, None), (cu.clone(), None), (cu, lambda: cu.add_(0)), (cu, "twice")):
        seen.clear()
        assert backend.verify("fused_recurrent_kda_fwd", *args, cu_seqlens=cu, inplace_final_state=False) == (
            True,
            None,
        )
        if callable(touch):
            touch()
        for _ in range(2 if touch == "twice" else 1):
            backend.fused_recurrent_kda_fwd(*args, cu_seqlens=call_cu, inplace_final_state=False)
        handed = call_cu is cu and not callable(touch)
        assert seen == [True, not handed] + ([True] if touch == "twice" else []), (touch, seen)


@pytest.mark.gpu
@cuda_ready
def test_gpu_fla_chunk_kda_runs_the_cuda_kernels(fla_kda, caplog):
    """On the H200: fla's chunk_kda runs kda's CUDA kernels, results equal kda.chunk_kda's."""
    assert DEVICE == "cuda"
    case = make_case(seq_lens=[300, 17], H=4, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=46)
    fla_registry()._logged.clear()
    with caplog.at_level(logging.INFO), kda.record_dispatch() as events:
        got = fla_kda.chunk_kda(*case.tensors(), **case.kwargs())
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert events[:3] == ["chunk_kda -> cuda", "cuda:prepare", "cuda:recurrence"], events
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(line.endswith("chunk_kda -> kda") for line in fla_log_lines(caplog))


@pytest.mark.gpu
@cuda_ready
def test_gpu_varlen_calls_through_fla_with_host_offsets_make_no_host_sync(fla_kda):
    """A serving engine's varlen prefill through fla's own chunk_kda, new lengths every call,
    with ``cu_seqlens_cpu``: no host synchronisation anywhere on the way (fla's dispatcher, kda's
    verifier, kda's call), under torch's sync debug mode set to error; the results are kda's own
    calls'. The same call without ``cu_seqlens_cpu`` must be caught (the verifier copies the
    offsets to the host to check them), which shows the mode is watching."""
    cases = [make_case(seq_lens=lens, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=60 + i)
             for i, lens in enumerate(([100, 7, 300], [1, 250, 33, 0, 64], [513]))]  # fmt: skip
    for c in cases:  # warm up: compiles and first-call setup may synchronise
        fla_kda.chunk_kda(*c.tensors(), **c.kwargs(cu_seqlens_cpu=c.cu_seqlens.cpu()))
    hosts = [c.cu_seqlens.cpu() for c in cases]  # copied before the watch
    results = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with kda.record_dispatch() as events:
            for c, host in zip(cases, hosts, strict=True):
                results.append(fla_kda.chunk_kda(*c.tensors(), **c.kwargs(cu_seqlens_cpu=host)))
        with pytest.raises(RuntimeError, match="synchroniz"):
            fla_kda.chunk_kda(*cases[0].tensors(), **cases[0].kwargs())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert events.count("chunk_kda -> cuda") == len(cases), events
    for c, got in zip(cases, results, strict=True):
        want = kda.chunk_kda(*c.tensors(), **c.kwargs())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
def test_gpu_fla_pooled_decode_runs_the_decode_kernel(fla_kda):
    """On a GPU fla's decode entry point with a state pool (what serving engines call) runs
    kda's decode kernel, equal to kda's own pool call."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    case = make_case(B=4, T=1, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=47)
    pool = torch.randn(6, 2, 128, 128, device="cuda")
    mine = pool.clone()
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device="cuda")
    kw = dict(A_log=case.A_log, dt_bias=case.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip
    with kda.record_dispatch() as events:
        fused_recurrent_kda_fwd(*case.tensors(), initial_state=pool, inplace_final_state=True,
                                ssm_state_indices=slots, **kw)  # fmt: skip
    assert "triton:pooled_decode" in events, events  # float32 pool: auto keeps it on Triton (kda.cuda.decode)
    kda.fused_recurrent_kda(*case.tensors(), initial_state=mine, inplace_final_state=True, ssm_state_indices=slots,
                            **kw)  # fmt: skip
    assert torch.equal(pool, mine)
