"""State pools (spec section 7): fused_recurrent_kda(..., inplace_final_state=True,
ssm_state_indices=, num_accepted_tokens=) reads and writes a pool of states in place, on the
Triton decode kernel (the interpreter on CPU) and the torch token loop. Every slot not named is
poisoned and checked untouched bit for bit; padding and out-of-range indices touch nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kda
from helpers import AUTO, DEVICE, make_case, rel, start_states

BACKENDS = ("torch", AUTO)  # AUTO: Triton's decode kernel (by name on CPU, auto on a GPU)
BAR = 1e-5  # float32 against the float64 token loop


def pool_case(lens, P, seed, layout=False, gate="softplus", HV=4):
    case = make_case(seq_lens=lens, H=2, HV=HV, K=16, V=24, gate=gate, state_v_first=layout, device=DEVICE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (P, HV, 24, 16) if layout else (P, HV, 16, 24)
    pool = torch.randn(shape, generator=gen).to(DEVICE)
    return case, pool


def decode_kwargs(case):
    """The case's flags for fused_recurrent_kda, without its state arguments."""
    kw = case.kwargs()
    for name in ("safe_gate", "initial_state", "output_final_state"):
        kw.pop(name, None)
    return kw


def plain_decode(case, h0):
    """The same tokens through fused_recurrent_kda without a pool: float64 token loop."""
    c64 = case.to(torch.float64, "cpu")
    kw = decode_kwargs(c64)
    return kda.fused_recurrent_kda(*c64.tensors(), initial_state=h0.double().cpu(), output_final_state=True,
                                   backend="torch", **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_one_d_indices_read_and_write_the_named_slots_only(backend, layout, index_dtype):
    """Slots 5, 2 and 0 serve three sequences, -1 is padding (starts from zeros, writes
    nothing), 9 and 7 are out of range (P = 7: the same, and no memory outside the pool; 7, the
    first slot past the pool, since a mutation audit of 2026-12-05 found a guard of `<= P`
    passing)."""
    lens, slots = [3, 1, 2, 4, 2, 2], [5, -1, 2, 9, 0, 7]
    case, pool = pool_case(lens, P=7, seed=61, layout=layout)
    before = pool.clone()
    idx = torch.tensor(slots, dtype=index_dtype, device=DEVICE)
    with kda.record_dispatch() as events:
        o, out = kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True,
                                         ssm_state_indices=idx, backend=backend, **decode_kwargs(case))  # fmt: skip
    assert out is pool
    if backend != "torch":
        assert "triton:pooled_decode" in events, events
    o_ref, ht_ref = plain_decode(case, start_states(before, slots))
    assert rel(o, o_ref) <= BAR
    for n, s in enumerate(slots):
        if 0 <= s < 7:
            assert rel(pool[s], ht_ref[n]) <= BAR, (n, s)
    untouched = [s for s in range(7) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched]), "a slot not named changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("columns", [4, 3])
def test_two_d_indices_with_accepted_tokens(backend, columns):
    """Speculative decoding: sequence 0 (3 tokens) starts from idx[0, accepted - 1] = slot 0 and
    writes its states after tokens 0, 1, 2 to slots 4, 0, 6; sequence 1 (2 tokens) starts from
    slot 1 and writes slots 1, 3; a padding column writes nothing. With 3 columns the longest
    sequence fills its row (the token bound at S, which a mutation audit of 2026-12-05 found
    no test reaching)."""
    lens, P = [3, 2], 8
    case, pool = pool_case(lens, P=P, seed=62)
    before = pool.clone()
    idx = torch.tensor([[4, 0, 6, -1], [1, 3, -1, -1]], device=DEVICE)[:, :columns].contiguous()
    accepted = torch.tensor([2, 1], device=DEVICE)
    o, _ = kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True,
                                   ssm_state_indices=idx, num_accepted_tokens=accepted, backend=backend,
                                   **decode_kwargs(case))  # fmt: skip
    o_ref, _ = plain_decode(case, start_states(before, [0, 1]))
    assert rel(o, o_ref) <= BAR
    # the state after each token, from plain decodes of the prefixes
    for n, (start, writes) in enumerate(((0, [4, 0, 6]), (1, [1, 3]))):
        for t, slot in enumerate(writes):
            offset = sum(lens[:n])
            prefix = {name: getattr(case, name)[:, offset : offset + t + 1] for name in ("q", "k", "v", "g", "beta")}
            _, ht = plain_decode(dataclasses.replace(case, cu_seqlens=None, **prefix), before[start : start + 1])
            assert rel(pool[slot], ht[0]) <= BAR, (n, t, slot)
    assert torch.equal(pool[[2, 5, 7]], before[[2, 5, 7]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepted_counts_outside_the_row_are_clamped_into_it(backend):
    """num_accepted_tokens 0 reads column 0, and 9 (S = 3) the last column: never another
    row of the indices (or memory before them)."""
    case, pool = pool_case([1, 1], P=6, seed=68)
    before = pool.clone()
    idx = torch.tensor([[2, 5, 4], [1, 0, 3]], device=DEVICE)
    accepted = torch.tensor([0, 9], device=DEVICE)
    o, _ = kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True,
                                   ssm_state_indices=idx, num_accepted_tokens=accepted, backend=backend,
                                   **decode_kwargs(case))  # fmt: skip
    o_ref, ht_ref = plain_decode(case, start_states(before, [2, 3]))
    assert rel(o, o_ref) <= BAR
    assert rel(pool[2], ht_ref[0]) <= BAR and rel(pool[1], ht_ref[1]) <= BAR


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_decode_through_the_pool_equals_one_prefill(backend):
    """chunk_kda's final state, put in slot 3, then two decode steps through the pool: the same
    outputs and final state as one prefill of every token."""
    T, cut = 37, 35
    case = make_case(T=T, H=2, HV=4, K=16, V=24, gate="softplus", device=DEVICE, seed=63)
    kw = case.kwargs()
    o_all, ht_all = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    head = [x[:, :cut] for x in case.tensors()]
    _, ht_head = kda.chunk_kda(*head, backend=backend, **kw)
    pool = torch.randn(5, *ht_head.shape[1:], device=DEVICE)
    pool[3] = ht_head[0]
    tail = [x[:, cut:].contiguous() for x in case.tensors()]
    dkw = {n: x for n, x in kw.items() if n not in ("safe_gate", "initial_state", "output_final_state")}
    o_tail, _ = kda.fused_recurrent_kda(*tail, initial_state=pool, inplace_final_state=True,
                                        ssm_state_indices=torch.tensor([3], device=DEVICE), backend=backend,
                                        **dkw)  # fmt: skip
    assert rel(o_tail, o_all[:, cut:]) <= 1e-4
    assert rel(pool[3], ht_all[0]) <= 1e-4


def test_in_place_without_indices_is_slot_n():
    case, pool = pool_case([2, 3], P=2, seed=64)
    before = pool.clone()
    o, _ = kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True, backend=AUTO,
                                   **decode_kwargs(case))  # fmt: skip
    o_ref, ht_ref = plain_decode(case, before)
    assert rel(o, o_ref) <= BAR and rel(pool, ht_ref) <= BAR


@pytest.mark.parametrize(
    "over, exc, says",
    [
        ({"inplace_final_state": False}, ValueError, "need `inplace_final_state=True`"),
        ({"ssm_state_indices": torch.tensor([[0, 1]])}, ValueError, "S >= 3"),
        ({"ssm_state_indices": torch.tensor([[0, 1], [2, 3]])}, ValueError, "S >= 3"),  # N right, S short
        ({"ssm_state_indices": torch.tensor([0.0, 1.0])}, TypeError, "int32 or int64"),
        ({"num_accepted_tokens": torch.tensor([1, 1])}, ValueError, "needs 2-D"),
        ({"initial_state": torch.zeros(4, 4, 16, 23)}, ValueError, "the state pool"),
        ({"initial_state": torch.zeros(4, 4, 16, 24, dtype=torch.float64)}, TypeError, "the state pool"),
        ({"initial_state": None}, ValueError, "needs the state pool"),
        ({"ssm_state_indices": None}, ValueError, "needs N=2 slots"),
        # (accepted and ignored until a review of 2026-12-05; the prefill into a pool refused it)
        ({"final_state_dtype": torch.bfloat16}, TypeError, "the pool's dtype torch.float32"),
    ],
)
def test_pool_arguments_are_checked(over, exc, says):
    case, pool = pool_case([3, 2], P=4, seed=65)
    args = dict(initial_state=pool.cpu(), inplace_final_state=True, ssm_state_indices=torch.tensor([0, 1]))
    args.update(over)
    c = case.to(device="cpu")
    with pytest.raises(exc, match=None) as info:
        kda.fused_recurrent_kda(*c.tensors(), backend="torch", **args, **decode_kwargs(c))
    assert says in str(info.value), str(info.value)


def test_pools_have_no_backward_and_cuda_passes_them_on():
    from kda.api import checked_problem
    from kda.cuda import BACKEND
    from kda.validation import check_pool

    case, pool = pool_case([3, 2], P=4, seed=66)
    q = case.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="no backward"):
        kda.fused_recurrent_kda(q, *case.tensors()[1:], initial_state=pool, inplace_final_state=True,
                                ssm_state_indices=torch.tensor([0, 1], device=DEVICE),
                                **decode_kwargs(case))  # fmt: skip
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **decode_kwargs(case))
    p = check_pool(p, pool, torch.tensor([0, 1], device=DEVICE), None)
    # float32 inputs, K = 16: the CUDA decode kernel's refusal names the first thing it lacks
    assert BACKEND.rejects(p).startswith("dtype torch.float32"), BACKEND.rejects(p)


def test_a_pool_that_requires_grad_decodes_under_no_grad():
    """A pool kept as a parameter (requires_grad) is refused only with grad mode on, as the
    inputs are: under no_grad the call runs and equals the same call on a pool that does not
    require grad (it was refused under no_grad too until a review of 2026-12-05)."""
    case, pool = pool_case([3, 2], P=4, seed=71)
    c = case.to(device="cpu")
    idx = torch.tensor([2, 0])
    trained, plain = pool.cpu().clone().requires_grad_(), pool.cpu().clone()
    with pytest.raises(ValueError, match="no backward"):
        kda.fused_recurrent_kda(*c.tensors(), initial_state=trained, inplace_final_state=True, ssm_state_indices=idx,
                                backend="torch", **decode_kwargs(c))  # fmt: skip
    with torch.no_grad():
        o_t, _ = kda.fused_recurrent_kda(*c.tensors(), initial_state=trained, inplace_final_state=True,
                                         ssm_state_indices=idx, backend="torch", **decode_kwargs(c))  # fmt: skip
        o_p, _ = kda.fused_recurrent_kda(*c.tensors(), initial_state=plain, inplace_final_state=True,
                                         ssm_state_indices=idx, backend="torch", **decode_kwargs(c))  # fmt: skip
    assert torch.equal(o_t, o_p) and torch.equal(trained, plain) and not torch.equal(plain, pool.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [False, True])
def test_prefill_into_the_pool(backend, layout):
    """chunk_kda(initial_state_indices=): sequence n starts from pool[idx[n]] and its final state
    goes back there; an empty sequence keeps its slot's state; padding (-1) and an index past
    the pool (9, P = 6) start from zeros and write nothing. Both state layouts (K != V), as a
    mutation audit of 2026-12-05 found state_v_first dropped on the way passing."""
    lens, slots, P = [20, 0, 9, 5, 3], [4, 2, -1, 9, 1], 6
    case = make_case(seq_lens=lens, H=2, HV=4, K=16, V=24, gate="softplus", state_v_first=layout, device=DEVICE,
                     seed=67)  # fmt: skip
    pool = torch.randn(P, 4, *((24, 16) if layout else (16, 24)), device=DEVICE)
    before = pool.clone()
    idx = torch.tensor(slots, device=DEVICE)
    kw = case.kwargs()
    kw.pop("initial_state")
    kw.pop("output_final_state")
    o, out = kda.chunk_kda(*case.tensors(), initial_state=pool, initial_state_indices=idx, backend=backend, **kw)
    assert out is pool
    c64 = case.to(torch.float64, "cpu")
    kw64 = {n: x for n, x in c64.kwargs().items() if n not in ("initial_state", "output_final_state")}
    o_ref, ht_ref = kda.chunk_kda(*c64.tensors(), initial_state=start_states(before, slots).double().cpu(),
                                  output_final_state=True, backend="torch", **kw64)  # fmt: skip
    assert rel(o, o_ref) <= BAR
    for n, s in enumerate(slots):
        if 0 <= s < P:
            assert rel(pool[s], ht_ref[n]) <= BAR, (n, s)
    assert torch.equal(pool[[0, 3, 5]], before[[0, 3, 5]])


def test_scatter_kernel_writes_valid_slots_only():
    """The masked copy a GPU prefill uses (kda.triton.decode.scatter_states_kernel), run on its
    own (under the interpreter on CPU): slots named by valid indices get their states, the rest
    of the pool keeps its bits."""
    import triton

    from kda.api import _scatter_states
    from kda.triton.decode import SCATTER_BLOCK, scatter_states_kernel

    pool = torch.randn(5, 2, 8, 40, device=DEVICE)
    before = pool.clone()
    states = torch.randn(4, 2, 8, 40, device=DEVICE)
    idx = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEVICE)
    if DEVICE == "cuda":
        _scatter_states(pool, idx, states)
    else:
        scatter_states_kernel[(4, triton.cdiv(640, SCATTER_BLOCK))](states, pool, idx, 5, SLOT=640, BLOCK=SCATTER_BLOCK)
    assert torch.equal(pool[3], states[0]) and torch.equal(pool[0], states[2])
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize(
    "idx, says",
    [(torch.tensor([0.0, 1.0]), "int32 or int64"), (torch.tensor([0, 1, 2]), "must be [N=2]")],
)
def test_prefill_indices_are_checked(idx, says):
    case = make_case(seq_lens=[3, 2], H=1, K=16, V=16, seed=68)
    kw = {n: x for n, x in case.kwargs().items() if n not in ("initial_state", "output_final_state")}
    with pytest.raises((TypeError, ValueError)) as info:
        kda.chunk_kda(*case.tensors(), initial_state=torch.zeros(4, 1, 16, 16), initial_state_indices=idx,
                      backend="torch", **kw)  # fmt: skip
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize("shape", [(), (3, 16), (1, 5, 1, 16, 1)])
def test_prefill_names_a_q_of_the_wrong_rank(shape):
    """A q of another rank than 4 with `initial_state_indices`: the usual `q` error (its B was read
    for N first: a 0-d q raised an IndexError, a review of 2026-12-07)."""
    case = make_case(T=5, H=1, K=16, V=16, seed=69)
    kw = {n: x for n, x in case.kwargs().items() if n not in ("initial_state", "output_final_state")}
    with pytest.raises(ValueError, match=r"`q` must be 4-D"):
        kda.chunk_kda(torch.randn(shape), *case.tensors()[1:], initial_state=torch.randn(2, 1, 16, 16),
                      initial_state_indices=torch.tensor([1]), backend="torch", **kw)  # fmt: skip


@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize(
    "over, says",
    [
        ({"cu_seqlens": torch.tensor([[0, 3, 5]])}, "`cu_seqlens` must be 1-D"),
        ({"cu_seqlens": torch.tensor([0.0, 3.0, 5.0])}, "`cu_seqlens` must be int64 or int32"),
        ({"initial_state": torch.zeros(4, 3, 16, 24)}, "(the state pool) must be [P, HV, "),
        ({"initial_state": torch.zeros(4, 2, 16)}, "(the state pool) must be [P, HV, "),
    ],
)
def test_prefill_names_a_bad_cu_seqlens_or_pool_shape(over, says, layout):
    """A review of 2026-12-05: the prefill into a pool took N from `cu_seqlens` and gathered
    the pool's slots before either was checked, so a 2-D `cu_seqlens` was reported as a bad
    `initial_state_indices` and a pool of the wrong HV by the gathered states' shape. Each is
    now named, the pool with the shape that was passed, in either state layout."""
    case = make_case(seq_lens=[3, 2], H=2, HV=2, K=16, V=24, seed=72, state_v_first=layout)
    kw = {n: x for n, x in case.kwargs().items() if n not in ("initial_state", "output_final_state")}
    shape = (4, 2, 24, 16) if layout else (4, 2, 16, 24)
    args = {"initial_state": torch.zeros(shape), "initial_state_indices": torch.tensor([0, 1])} | over
    kw.update({n: x for n, x in args.items() if n == "cu_seqlens"})
    with pytest.raises((TypeError, ValueError)) as info:
        kda.chunk_kda(*case.tensors(), initial_state=args["initial_state"],
                      initial_state_indices=args["initial_state_indices"], backend="torch", **kw)  # fmt: skip
    message = str(info.value)
    assert says in message, message
    if "initial_state" in over:  # the pool as passed, not the gathered [N, ...] states
        assert message.endswith(str(list(over["initial_state"].shape))), message


def test_prefill_takes_strided_indices_and_an_empty_pool_and_refuses_what_the_plain_call_does():
    """From a review (2026-12-04): strided indices are read as their values (the GPU's scatter
    kernel read them at unit stride: other slots written); a pool of no slots with padding
    indices runs from zeros (index_select of the empty pool failed); the prefill refuses grad on
    any input in grad mode (only q and the pool were asked), return_intermediate_states as the
    plain call does (it was dropped), and a final_state_dtype other than the pool's (ignored)."""
    from kda import validation

    case = make_case(seq_lens=[3, 2], H=1, K=16, V=16, seed=69)
    kw = {n: x for n, x in case.kwargs().items() if n not in ("initial_state", "output_final_state")}
    strided = torch.tensor([[1, 9], [3, 9]])[:, 0]
    assert not strided.is_contiguous()
    pool = torch.randn(4, 1, 16, 16)
    _, idx = validation.pool_prefill_sequences(case.q, pool, strided, case.cu_seqlens)
    assert idx.is_contiguous() and torch.equal(idx, strided)
    pools = [pool.clone(), pool.clone()]
    for p, i in zip(pools, (strided, strided.contiguous()), strict=True):
        kda.chunk_kda(*case.tensors(), initial_state=p, initial_state_indices=i, backend="torch", **kw)
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], pool)

    empty = torch.zeros(0, 1, 16, 16)
    o, out = kda.chunk_kda(*case.tensors(), initial_state=empty, initial_state_indices=torch.tensor([-1, -1]),
                           backend="torch", **kw)  # fmt: skip
    o_zero, _ = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    assert out is empty and torch.equal(o, o_zero)

    idx = torch.tensor([0, 2])
    v = case.v.clone().requires_grad_()
    tensors = (case.q, case.k, v, case.g, case.beta)
    with pytest.raises(ValueError, match="no backward"):
        kda.chunk_kda(*tensors, initial_state=pool.clone(), initial_state_indices=idx, backend="torch", **kw)
    with torch.no_grad():
        kda.chunk_kda(*tensors, initial_state=pool.clone(), initial_state_indices=idx, backend="torch", **kw)
    for over, error in (({"return_intermediate_states": True}, ValueError),
                        ({"final_state_dtype": torch.bfloat16}, TypeError)):  # fmt: skip
        with pytest.raises(error):
            kda.chunk_kda(*case.tensors(), initial_state=pool.clone(), initial_state_indices=idx, backend="torch",
                          **kw, **over)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sequence_with_no_tokens_leaves_its_slot_to_the_one_that_has_tokens(backend):
    """Two sequences name slot 2; the second has no tokens. The slot keeps the state the first
    writes there, as the torch token loop (the sequences in order) gives: a zero-token sequence
    writes nothing back. On a GPU a write-back would race with the first sequence's programs;
    the interpreter runs programs one after another, so there it checks the semantics only."""
    case, pool = pool_case([3, 0], P=4, seed=67)
    idx = torch.tensor([2, 2], device=DEVICE)
    mine, model = pool.clone(), pool.double().cpu()
    kda.fused_recurrent_kda(*case.tensors(), initial_state=mine, inplace_final_state=True, ssm_state_indices=idx,
                            backend=backend, **decode_kwargs(case))  # fmt: skip
    c64 = case.to(torch.float64, "cpu")
    kda.fused_recurrent_kda(*c64.tensors(), initial_state=model, inplace_final_state=True,
                            ssm_state_indices=idx.cpu(), backend="torch", **decode_kwargs(c64))  # fmt: skip
    assert not torch.equal(model[2].float(), pool[2].cpu()), "the slot did not move: the test would see nothing"
    assert rel(mine[2], model[2]) <= BAR
    assert torch.equal(mine[[0, 1, 3]], pool[[0, 1, 3]])


def test_triton_decode_stores_nothing_back_for_a_sequence_with_no_tokens(monkeypatch):
    """The guard itself (kda/triton/decode.py: the in-place store masked by bos < eos). In the pool
    a write-back would store the very value read, which no outside check sees (with the guard
    removed the test above passed: a review of the tests, 2026-12-06), so here the kernel, still
    told it runs in place, stores into a NaN buffer of its own: the slot of the sequence with no
    tokens stays NaN there, the other sequence's is written, and no other slot is."""
    import kda.triton.decode as triton_decode

    real, targets = triton_decode.decode_kernel, []

    class Redirected:  # decode_kernel[grid](..., h0, ht, ...) with ht swapped
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert kwargs["IN_PLACE"] and args[8] is args[9], "not the pool's in-place launch"
                targets.append(torch.full_like(args[9], float("nan")))
                return real[grid](*args[:9], targets[-1], *args[10:], **kwargs)

            return launch

    monkeypatch.setattr(triton_decode, "decode_kernel", Redirected())
    case, pool = pool_case([3, 0], P=4, seed=68)
    idx = torch.tensor([2, 1], device=DEVICE)
    with kda.record_dispatch() as events:
        kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                backend=AUTO, **decode_kwargs(case))  # fmt: skip
    assert "triton:pooled_decode" in events and len(targets) == 1, (events, len(targets))
    (target,) = targets
    assert target[1].isnan().all(), "the sequence with no tokens stored its slot back"
    assert target[2].isfinite().all() and target[[0, 3]].isnan().all()


@pytest.mark.gpu
def test_gpu_two_d_indices_need_a_column_even_with_unchecked_lengths(monkeypatch):
    """With lengths never copied to the host, S >= 1 is still required: the first slot is read
    from column 0 (or accepted - 1) even for a sequence with no tokens."""
    from kda import validation

    monkeypatch.setattr(validation, "CHECK_CU_SEQLENS", "0")
    case, pool = pool_case([3, 2], P=4, seed=68)
    with pytest.raises(ValueError, match="S >= 1"):
        kda.fused_recurrent_kda(*case.tensors(), initial_state=pool, inplace_final_state=True,
                                ssm_state_indices=torch.zeros(2, 0, dtype=torch.int64, device=DEVICE),
                                **decode_kwargs(case))  # fmt: skip
