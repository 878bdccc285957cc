"""The segment split of long sequences (kda.segments, KDA_SEGMENT_TOKENS): the same outputs and
final states as the uncut call, on the torch backend and Triton (the interpreter on CPU)."""

from __future__ import annotations

import pytest

import kda
from helpers import AUTO, DEVICE, assert_bands_untouched, guarded, make_case, rel

BACKENDS = ("torch", AUTO)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [dict(B=2, T=100), dict(seq_lens=[70, 0, 5, 40, 33])], ids=["batched", "varlen"])
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("chain", ["steps", "blocks", "kernel"])
@pytest.mark.parametrize("KV", [(16, 8), (16, 32)], ids=["K>V", "K<V"])
def test_split_equals_the_uncut_call(monkeypatch, backend, shape, layout, chain, KV):
    """32-token segments (two chunks): sequences over several segments, one shorter than a
    segment, an empty one, a partial last chunk; mild decays so that each segment's entering
    state matters; an initial state and the final state. The boundary chain one segment a step,
    in blocks (of 2 for the 3 and 4 segments here), or in one Triton kernel (the default on a
    GPU; the interpreter on the CPU). K > V: P from two runs of the identity's columns; K < V:
    from one, the first K columns of its final state."""
    from kda import segments
    from kda.triton.segments import chain_states

    torch_chain = segments.chain_boundaries
    if chain == "blocks":  # blocks of 2 (the torch form on a GPU for K over 128, past CHAIN_STEPS_UP_TO segments)
        monkeypatch.setattr(segments, "chain_boundaries", lambda P, R, S0, counts: torch_chain(P, R, S0, counts, 2))
    elif chain == "steps":
        monkeypatch.setattr(segments, "chain_boundaries", lambda P, R, S0, counts: torch_chain(P, R, S0, counts, 1))
    elif DEVICE == "cpu":  # (on a GPU the default takes the kernel)
        monkeypatch.setattr(segments, "chain_boundaries", chain_states)
    stepped, steps = [], segments.chain_steps  # the counts each chain of steps walked
    monkeypatch.setattr(segments, "chain_steps", lambda P, R, S0, n: stepped.append(n) or steps(P, R, S0, n))
    K, V = KV
    case = make_case(**shape, H=1, HV=2, K=K, V=V, gate="precomputed", state_v_first=layout, device=DEVICE, seed=81)
    case.g = case.g * 0.02
    kw = case.kwargs()
    want = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    with kda.record_dispatch() as events:
        got = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
    assert "segments:32" in events, events
    assert rel(got[0], want[0]) <= 1e-5 and rel(got[1], want[1]) <= 1e-5, (rel(got[0], want[0]), rel(got[1], want[1]))
    assert ("triton:chain_states" in events) == (chain == "kernel"), events
    segs = [4, 4] if "T" in shape else [3, 0, 1, 2, 2]  # 100 tokens: 32, 32, 32, 4
    if chain == "kernel":
        assert stepped == [], stepped
    elif chain == "steps":
        assert stepped == [segs], stepped
    else:  # the sequences of more than 2 segments by blocks (their blocks' chain), the rest by steps
        longs, shorts = [-(-n // 2) for n in segs if n > 2], [n for n in segs if n <= 2]
        assert stepped == [longs] + ([shorts] if shorts else []), stepped


@pytest.mark.parametrize("what", ["bf16 h0 and final state", "float64"])
def test_split_keeps_full_precision_between_segments(monkeypatch, what):
    """The transitions and the states entering the segments stay in the full-precision state
    dtype whatever the caller's state dtypes (a bf16 final_state_dtype once rounded P and R, a
    bf16 h0 every segment's start: 4e-4 on o against 7e-8 otherwise), and float64 inputs split
    in float64 (their float32 zero state was refused)."""
    import torch

    case = make_case(seq_lens=[100, 7, 64], H=1, HV=2, K=16, V=8, gate="precomputed", seed=87)
    case.g = case.g * 0.02
    if what == "float64":
        case, kw, tol = case.to(torch.float64), {}, 1e-12
    else:
        kw, tol = dict(initial_state=case.initial_state.bfloat16(), final_state_dtype=torch.bfloat16), 1e-5
    kw = case.kwargs(**kw)
    want = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    with kda.record_dispatch() as events:
        got = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    assert "segments:32" in events, events
    assert got[1].dtype == want[1].dtype
    # (a bf16 final state: the same float32 state rounded once on each side)
    moved = (rel(got[0], want[0]), rel(got[1].double(), want[1].double()))
    assert moved[0] <= tol and moved[1] <= (tol if what == "float64" else 4e-3), moved


@pytest.mark.parametrize("block", [None, 1, 2, 3, 5, 13])
@pytest.mark.parametrize("counts", [[3, 0, 1, 12, 5, 2], [12, 9, 16]])
def test_chain_boundaries_step_all_sequences_together(block, counts):
    """``segments.chain_boundaries`` (one batched product a step, sequences sorted by segment
    count; in blocks, the maps composed within each block first, for the sequences of more than
    ``block`` segments: ``block``, None for the default, one step a segment on the CPU) against a
    plain loop sequence by sequence, with an empty sequence among them."""
    import torch

    from kda import segments

    gen = torch.Generator().manual_seed(88)
    P = torch.randn(sum(counts), 2, 4, 4, generator=gen, dtype=torch.float64) * 0.5
    R = torch.randn(sum(counts), 2, 4, 3, generator=gen, dtype=torch.float64)
    S0 = torch.randn(len(counts), 2, 4, 3, generator=gen, dtype=torch.float64)
    starts, finals = segments.chain_boundaries(P, R, S0, counts, block)
    j = 0
    for n, count in enumerate(counts):
        S = S0[n]
        for _ in range(count):
            assert torch.allclose(starts[j], S, rtol=1e-12, atol=1e-12), (n, j)
            S = P[j] @ S + R[j]
            j += 1
        assert torch.allclose(finals[n], S, rtol=1e-12, atol=1e-12), n


@pytest.mark.parametrize(
    "counts, HV, K, V",
    [([3, 0, 1, 12, 5, 2], 2, 16, 8), ([4, 2], 1, 20, 40), ([2, 3], 2, 128, 128)]
    + ([([64], 8, 128, 128), ([17, 1, 40, 0], 4, 100, 72)] if DEVICE == "cuda" else []),
)
def test_boundary_chain_in_one_kernel(counts, HV, K, V):
    """kda.triton.segments.chain_states (the split's boundary chain on a GPU; the interpreter on
    CPU) against segments.chain_steps' float64 products: an empty sequence among them, K and V not
    powers of two (padded in the kernel) or V over one program's 16 columns, float32 P and R with
    R in [V, K] strides (as the transitions leave a V-first layout's), float64 S0. Both outputs
    NaN-filled inside larger NaN buffers: every element written, nothing beside them. On a GPU also
    the 2M H8 call's chain (64 segments, 8 heads, K = V = 128)."""
    import torch

    from kda import segments
    from kda.triton.segments import chain_states

    gen = torch.Generator().manual_seed(89 + K)
    segs = sum(counts)
    P = torch.randn(segs, HV, K, K, generator=gen) * (0.9 / K**0.5)
    R = torch.randn(segs, HV, V, K, generator=gen).transpose(-1, -2)
    S0 = torch.randn(len(counts), HV, K, V, generator=gen, dtype=torch.float64)
    P, R, S0 = P.to(DEVICE), R.to(DEVICE), S0.to(DEVICE)
    state = HV * K * V  # a state's worth of NaN before and after each output
    starts_buf, starts_out, _ = guarded((segs, HV, K, V), torch.float64, DEVICE, guard=state)
    finals_buf, finals_out, _ = guarded((len(counts), HV, K, V), torch.float64, DEVICE, guard=state)
    with kda.record_dispatch() as events:
        starts, finals = chain_states(P, R, S0, counts, out=(starts_out, finals_out))
    assert events == ["triton:chain_states"], events
    want_starts, want_finals = segments.chain_steps(P, R, S0, counts)
    assert not starts.isnan().any() and not finals.isnan().any()
    assert_bands_untouched(starts_buf, state, "the segments' entering states")
    assert_bands_untouched(finals_buf, state, "the final states")
    assert rel(starts, want_starts) <= 1e-13 and rel(finals, want_finals) <= 1e-13, (
        rel(starts, want_starts),
        rel(finals, want_finals),
    )


@pytest.mark.parametrize("K", [128, 136])
def test_chain_boundaries_take_the_kernel_on_a_gpu_up_to_k_128(K):
    """``segments.chain_boundaries`` on the device's tensors: the kernel on a GPU for K up to
    MAX_SIDE, the torch blocks past it (and on the CPU), both equal to the steps."""
    import torch

    from kda import segments

    gen = torch.Generator().manual_seed(90 + K)
    counts = [10, 3]
    P = (torch.randn(13, 1, K, K, generator=gen) * (0.9 / K**0.5)).to(DEVICE)
    R = torch.randn(13, 1, K, 16, generator=gen).to(DEVICE)
    S0 = torch.randn(2, 1, K, 16, generator=gen, dtype=torch.float64).to(DEVICE)
    with kda.record_dispatch() as events:
        starts, finals = segments.chain_boundaries(P, R, S0, counts)
    assert ("triton:chain_states" in events) == (DEVICE == "cuda" and K <= 128), events
    want_starts, want_finals = segments.chain_steps(P, R, S0, counts)
    assert rel(starts, want_starts) <= 1e-13 and rel(finals, want_finals) <= 1e-13


def test_boundary_chain_kernel_refuses_what_it_cannot_take():
    """chain_states names the argument that does not fit: K over MAX_SIDE, shapes that disagree,
    an ``out`` of the wrong dtype or layout."""
    import torch

    from kda.triton.segments import MAX_SIDE, chain_states

    P, R, S0 = torch.zeros(3, 1, 16, 16), torch.zeros(3, 1, 16, 8), torch.zeros(2, 1, 16, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="K must be at most"):
        K = MAX_SIDE + 16
        chain_states(torch.zeros(1, 1, K, K), torch.zeros(1, 1, K, 8), torch.zeros(1, 1, K, 8), [1])
    with pytest.raises(ValueError, match="disagree"):
        chain_states(P, R, S0, [1, 1])
    good = (torch.empty(3, 1, 16, 8, dtype=torch.float64), torch.empty(2, 1, 16, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out's starts must be contiguous float64"):
        chain_states(P, R, S0, [2, 1], out=(good[0].float(), good[1]))
    with pytest.raises(ValueError, match="out's finals must be contiguous float64"):
        chain_states(P, R, S0, [2, 1], out=(good[0], good[1].transpose(-1, -2).contiguous().transpose(-1, -2)))


# (the launches' forms beside the default: one unrolled tile in a head's order (the launch until
# run 151), tiles unrolled or in Triton's pipelined loop, both program orders, the V side in two
# slices, fewer warps; V = 8 pads to 16, so two slices go as K = V = 32 below)
LAUNCHES = [
    dict(tiles=1, stages=0, heads_first=False),
    dict(tiles=2, stages=0),
    dict(tiles=3, stages=0, heads_first=True),
    dict(tiles=3, stages=2, heads_first=False),
    dict(tiles=1, heads_first=True, v_parts=2, warps=4),
    dict(tiles=2, stages=3, v_parts=2),
]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_outputs_from_entering_states_in_one_kernel(launch):
    """kda.triton.segments.add_entering_states (the split's last step on a GPU for 16-bit outputs;
    the interpreter on CPU) against segments.entering_outputs' float64 products: segments of 5, 130
    (two blocks of 128 tokens), 1 and 64 tokens, K = 16 and V = 8 (padded to 16 in the kernel), bf16
    o, the states with [V, K] strides (as the chain leaves states of the V-first layout); every
    element of a NaN-filled output written. Each of LAUNCHES (tiles a program, the tiles' loop,
    the programs' order, V slices, warps) gives the same bits as the default launch; with two V
    slices the heads are K = V = 32 (8 columns pad to one slice of 16)."""
    import itertools

    import torch

    from kda import segments
    from kda.triton.segments import Launch, add_entering_states, block_table

    launch = Launch(**launch)
    lengths, HV, K, V = [5, 130, 1, 64], 2, *((32, 32) if launch.v_parts > 1 else (16, 8))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)])
    assert block_table(offsets).tolist() == [[0, 0, 5], [1, 5, 133], [1, 133, 135], [2, 135, 136], [3, 136, 200]]
    gen = torch.Generator().manual_seed(89)
    T = sum(lengths)
    o_zero = torch.randn(1, T, HV, V, generator=gen).bfloat16()
    o_P = torch.randn(1, T, HV, K, generator=gen).bfloat16()
    starts = torch.randn(len(lengths), HV, V, K, generator=gen, dtype=torch.float64).transpose(-1, -2)
    want = segments.entering_outputs(o_zero, o_P, starts, offsets)  # (CPU tensors: the float64 products)
    on = [x.to(DEVICE) for x in (o_zero, o_P, starts)]
    got = add_entering_states(*on, offsets, out=torch.full_like(on[0], float("nan")), launch=launch).cpu()
    assert not got.isnan().any(), "an output element was not written"
    assert torch.equal(got, add_entering_states(*on, offsets).cpu())
    # nearly the same sum rounded to bf16 (S to 16 bits in the kernel, so a sum that cancels can
    # move by more than its own last bit; and the interpreter truncates to bf16): at most a bf16
    # step of the largest value apart, and by a bf16 step or less in RMS
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    assert rel(got, want) <= 2**-7, rel(got, want)
    with pytest.raises(TypeError, match="bfloat16"):  # (float16 o_P against bf16 parts of S: no dot)
        add_entering_states(on[0].half(), on[1].half(), on[2], offsets)
    with pytest.raises(ValueError, match="at most 128"):
        big = torch.zeros(1, T, HV, 256, dtype=torch.bfloat16, device=DEVICE)
        add_entering_states(big, on[1], on[2].new_zeros(len(lengths), HV, K, 256), offsets)
    with pytest.raises(ValueError, match="v_parts must split"):  # (slices of 4 or 8 columns)
        add_entering_states(*on, offsets, launch=Launch(v_parts=4))
    with pytest.raises(ValueError, match="tiles must be at least 1"):
        Launch(tiles=0)


def test_output_launch_setting_reads_every_field_and_refuses_the_rest():
    from kda.triton.segments import SETTING, Launch, launch_from

    assert launch_from("") == Launch()
    assert launch_from("tiles=3, stages=0,heads_first=0,v_parts=2,warps=4") == Launch(3, 0, False, 2, 4)
    assert launch_from("heads_first=0") == Launch(heads_first=False) != Launch()
    for bad in ("tiles=x", "tile=2", "tiles", "tiles=-1"):
        with pytest.raises(ValueError, match=SETTING):
            launch_from(bad)
    with pytest.raises(ValueError, match="warps must be at least 1"):
        launch_from("warps=0")


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
    runs 69-70): the H8 and H16 cases split, the H32 cases not."""
    from kda import segments

    # runs 69-70: 16384 or 32768 at 2M tokens (within 0.4%), 8192 at 524288 and 131072 H8, 16384 at H16
    assert segments.auto_span([2097152], 8, 132) == 32768
    assert segments.auto_span([524288], 8, 132) == 8192 and segments.auto_span([131072], 8, 132) == 8192
    assert segments.auto_span([8 * 2097152], 8, 132) == 65536  # past the last length: the longest
    assert segments.auto_span([524288], 16, 132) == 16384
    assert segments.auto_span([131072], 32, 132) == 0 and segments.auto_span([32768], 32, 132) == 0
    long = segments.long_tokens()
    assert segments.auto_span([long - 16], 1, 132) == 0  # short of AUTO_MIN_SEGMENTS segments
    # one long sequence among short ones: only the long one's segments count
    assert segments.auto_span([300] * 500 + [long], 8, 132) == segments.AUTO_SPANS[0]
    assert segments.auto_span([long] * 3, 8, 132) == 0  # 24 chains: the uncut call fills enough SMs
    assert segments.auto_span([long] * 3, 8, 264) == segments.AUTO_SPANS[0]  # a GPU of twice the SMs
    assert segments.auto_span([], 8, 132) == 0
    # each bound met exactly (a mutation audit of 2026-12-05 found both moved by one passing):
    # chains * AUTO_SMS_PER_PAIR == SMs still splits; AUTO_CHAINS_PER_SM * SMs segment chains fit a span
    pairs, fill = segments.AUTO_SMS_PER_PAIR, segments.AUTO_CHAINS_PER_SM
    assert segments.auto_span([131072], 16, 16 * pairs) == 8192
    assert segments.auto_span([fill * 132 // 8 * 8192], 8, 132) == 8192
    assert segments.auto_span([(fill * 132 // 8 + 1) * 8192], 8, 132) == 16384


def test_setting_unset_is_automatic_zero_is_off(monkeypatch):
    from kda import segments

    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    assert segments.segment_tokens() is None
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "0")
    assert segments.segment_tokens() == 0
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "4096")
    assert segments.segment_tokens() == 4096


def test_no_automatic_split_off_the_cuda_path(monkeypatch):
    """The automatic split was measured on the CUDA path only: CPU tensors (auto, and torch or
    Triton by name) are never split unless KDA_SEGMENT_TOKENS asks. (The GPU test below checks
    Triton by name on GPU tensors, where only the backend check stands.)"""
    from kda import segments

    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    monkeypatch.setattr(segments, "AUTO_SEGMENT_TOKENS", 32)
    monkeypatch.setattr(segments, "AUTO_SPANS", (32,))
    monkeypatch.setattr(segments, "AUTO_MIN_SEGMENTS", 2)
    case = make_case(T=96, H=1, K=16, V=8, device=DEVICE, seed=85)
    for backend in ("auto", "torch", "triton"):
        with kda.record_dispatch() as events:
            kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
        assert not any(e.startswith("segments") for e in events), (backend, events)


def test_no_call_is_split_under_a_graph_capture(monkeypatch):
    """KDA_SEGMENT_TOKENS forces the split on any backend, but not under a CUDA-graph capture,
    which the split's copies of its segment table to the device would fail (dispatch.capturing,
    asked on every route since a review of 2026-12-04; the GPU test below captures for real)."""
    import kda.dispatch

    case = make_case(T=80, H=1, K=16, V=8, gate="precomputed", seed=87)
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    for under_capture, want in ((False, True), (True, False)):
        monkeypatch.setattr(kda.dispatch, "capturing", lambda q, c=under_capture: c)
        with kda.record_dispatch() as events:
            kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
        assert ("segments:32" in events) == want, (under_capture, events)


@pytest.mark.gpu
def test_gpu_split_call_waits_for_no_device_sync(monkeypatch):
    """The split's host tables (the segment offsets, the chain's indices, the outputs' block table)
    reach the device in stream order (segments.to_device, 3164ca1): a pageable copy waits for the
    stream to drain, and one queued after the transition runs left the GPU idle while the host
    queued the boundary chain (the 2M H8 call's wall time about 5 ms above its kernels' sum, H200,
    2026-12-05, run 150). Under torch's sync debug mode a synchronizing call raises. 19 segments
    (the chain in blocks: more than CHAIN_STEPS_UP_TO) at both K2 kinds."""
    import torch

    import kda.cuda
    from helpers import cuda_ready

    if cuda_ready.args[0]:
        pytest.skip(cuda_ready.kwargs["reason"])
    case = make_case(T=4608 + 80, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=91)
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "256")
    args, kw = case.tensors(), case.kwargs()
    for warps in (None, "wgmma2"):
        monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", warps)
        want = kda.chunk_kda(*args, **kw)  # (compiles the Triton kernels, fills the pinned-memory cache)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with kda.record_dispatch() as events:
                got = kda.chunk_kda(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert "segments:256" in events and "cuda:prepare" in events, events
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_automatic_split_runs_where_chains_are_few(monkeypatch):
    """A call the CUDA path runs, one long sequence and one head: split automatically (at the
    real constants, 131152 tokens; and at small ones), at auto_span's length, said in the dispatch
    events, with the uncut call's results; KDA_SEGMENT_TOKENS=0 keeps it uncut."""
    import torch

    from helpers import cuda_ready
    from kda import segments

    if cuda_ready.args[0]:
        pytest.skip(cuda_ready.kwargs["reason"])
    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    L, sms = segments.AUTO_SEGMENT_TOKENS, torch.cuda.get_device_properties(0).multi_processor_count
    for unit, spans in ((L, segments.AUTO_SPANS), (64, (64, 128))):
        monkeypatch.setattr(segments, "AUTO_SEGMENT_TOKENS", unit)
        monkeypatch.setattr(segments, "AUTO_SPANS", spans)
        T = segments.AUTO_MIN_SEGMENTS * unit + 80
        span = segments.auto_span([T], 1, sms)  # (the real constants: 8192 on 132 SMs)
        assert span in spans, span
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
    # Triton by name on the same GPU inputs, and a CUDA-graph capture: never split automatically
    # (the split copies its segment table to the device, which a capture refuses)
    with kda.record_dispatch() as events:
        kda.chunk_kda(*case.tensors(), backend="triton", **case.kwargs())
    assert not any(e.startswith("segments") for e in events), events
    kw = case.kwargs()
    kda.chunk_kda(*case.tensors(), **kw)  # (warm: the capture launches what is already loaded)
    for forced in (None, "64"):  # nor when KDA_SEGMENT_TOKENS asks (the capture failed then until 2026-12-04)
        if forced:
            monkeypatch.setenv("KDA_SEGMENT_TOKENS", forced)
        graph = torch.cuda.CUDAGraph()
        with kda.record_dispatch() as events, torch.cuda.graph(graph):
            captured = kda.chunk_kda(*case.tensors(), **kw)
        graph.replay()
        assert not any(e.startswith("segments") for e in events), (forced, events)
        assert rel(captured[0], want[0]) <= 1e-2, (forced, rel(captured[0], want[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("span", [512, 1024])
@pytest.mark.parametrize("warps", [None, "wgmma2"])
def test_gpu_split_bf16_matches_the_uncut_call(monkeypatch, layout, span, warps):
    """bf16 inputs on the CUDA path split into 10 segments (the chain in blocks) or 5 (one step a
    segment), states in either layout: the uncut call's results. (The V-first states once reached
    the outputs' kernel with [V, K] strides read as [K, V]: o 0.13 off at 8 segments, run 66.) At
    the rule's K2 (mma.sync here: few pairs), a launch a run, and on the wgmma K2, whose two
    transition runs go in one launch (kda.cuda.forward.runs_kind)."""
    import torch

    import kda.cuda
    from helpers import cuda_ready

    if cuda_ready.args[0]:
        pytest.skip(cuda_ready.kwargs["reason"])
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", warps)
    case = make_case(T=4608 + 80, H=2, K=128, V=128, dtype=torch.bfloat16, state_v_first=layout, device="cuda",
                     seed=90)  # fmt: skip
    case.g = case.g - 6.0  # long memory: a segment's entering state carries through it
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "0")
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", str(span))
    with kda.record_dispatch() as events:
        got = kda.chunk_kda(*case.tensors(), **case.kwargs())
    assert f"segments:{span}" in events, events
    # the two transition runs on one K1 (kda.cuda.forward.chunk_forward_runs), in one K2 launch on wgmma
    launches = ["cuda:recurrence:runs"] if warps else ["cuda:recurrence"] * 2
    assert events.count("cuda:prepare") == 1, events
    assert [e for e in events if e in ("cuda:recurrence", "cuda:recurrence:runs")] == launches, events
    # two bf16-input computations of the same function: each about 3e-3 from fp64
    moved = (rel(got[0], want[0]), rel(got[1], want[1]))
    assert max(moved) <= 1e-2, moved


def test_transition_runs_give_each_calls_result_and_share_where_the_backend_can(monkeypatch):
    """kda.api.chunk_kda_runs (the split's transition runs): each run's result is chunk_kda's for
    it, bit for bit, a v of None being zeros; a backend with ``run_shared`` (the CUDA path: K1 once
    for all) receives all the runs in one call with which v are zeros, and one without runs them
    one by one."""
    from dataclasses import replace

    import torch

    from kda import dispatch
    from kda.api import chunk_kda_runs

    case = make_case(seq_lens=[40, 0, 23], H=2, K=16, V=8, gate="precomputed", device=DEVICE, seed=82)
    q, k, v, g, beta = case.tensors()
    kw = case.kwargs()
    kw.pop("initial_state"), kw.pop("output_final_state")
    shape = case.initial_state.shape
    # as affine_transitions gives them: R's run with no initial state, P's with one (v None: v = 0)
    runs = [(v, None), (None, torch.randn(shape, device=DEVICE))]
    expected = [
        kda.chunk_kda(q, k, v if v_run is not None else torch.zeros_like(v), g, beta, initial_state=h0,
                      output_final_state=True, backend="torch", **kw)
        for v_run, h0 in runs
    ]  # fmt: skip
    backend = dispatch.get_backend("torch")
    assert not hasattr(backend, "run_shared")
    shared = []
    for sharing in (False, True):
        if sharing:
            run_one = backend.run

            def run_shared(problems, v_zero):  # (the zero v's problem carries v as its template)
                shared.append((problems, v_zero))
                return [run_one(replace(p, v=torch.zeros_like(p.v)) if z else p) for p, z in zip(problems, v_zero)]

            monkeypatch.setattr(backend, "run_shared", run_shared, raising=False)
        got = chunk_kda_runs(q, k, g, beta, runs, kw | {"backend": "torch"})
        for (o, ht), (o_ref, ht_ref) in zip(got, expected, strict=True):
            assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    ((problems, v_zero),) = shared
    assert v_zero == [False, True]
    assert all(p.v is v and p.q is q for p in problems)
    assert problems[0].initial_state is None and problems[1].initial_state is runs[1][1]


def test_split_reads_the_deprecated_layout_name(monkeypatch):
    """``transpose_state_layout=True`` (fla's old name for ``state_v_first``) in a split call: the
    segments' transitions and states in the V-first layout, as the uncut call's. (Until 2026-12-03
    the split read only ``state_v_first`` and got o 1.16 off.)"""
    import warnings

    import torch

    case = make_case(seq_lens=[70, 0, 33], H=1, HV=2, K=32, V=32, gate="precomputed", state_v_first=True,
                     dtype=torch.float64, device=DEVICE, seed=87)  # fmt: skip
    case.g = case.g * 0.05  # mild decays: a segment's entering state carries through it
    kw = case.kwargs()
    kw["transpose_state_layout"] = kw.pop("state_v_first")
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "0")
    want = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "16")
    with warnings.catch_warnings(record=True) as caught, kda.record_dispatch() as events:
        warnings.simplefilter("always")
        got = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    assert "segments:16" in events, events
    assert any("transpose_state_layout" in str(w.message) for w in caught)
    assert rel(got[0], want[0]) <= 1e-10 and rel(got[1], want[1]) <= 1e-10, (rel(got[0], want[0]), rel(got[1], want[1]))


def test_split_of_a_padded_graph_mode_buffer(monkeypatch):
    """fla's use_graph layout through the split: the offsets padded with empty sequences to
    max_num_seqs and a buffer longer than they cover. The split's own calls (the segments' offsets)
    were checked against max_num_seqs and refused until a review of 2026-12-07."""
    import dataclasses

    import torch

    case = make_case(seq_lens=[70, 0, 9, 0, 0], H=1, HV=2, K=16, V=8, gate="precomputed", seed=88)
    case.g = case.g * 0.02
    pad = {name: torch.cat([x, torch.randn(1, 5, *x.shape[2:])], dim=1) for name, x in
           zip(("q", "k", "v", "g", "beta"), case.tensors())}  # fmt: skip
    padded = dataclasses.replace(case, **pad)
    want = kda.chunk_kda(*case.tensors(), backend="torch", **case.kwargs())
    monkeypatch.setenv("KDA_SEGMENT_TOKENS", "32")
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*padded.tensors(), backend="torch", **padded.kwargs(), use_graph=True, max_num_seqs=5)
    assert "segments:32" in events, events
    assert rel(o[:, :79], want[0]) <= 1e-5 and rel(ht, want[1]) <= 1e-5
    assert (o[:, 79:] == 0).all()
