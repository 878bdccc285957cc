"""Bad input raises ValueError or TypeError naming the argument, before any launch."""

import warnings

import pytest
import torch

import kda
from helpers import make_case


def base(**over):
    case = make_case(T=20, H=2, HV=4, K=16, V=16, gate="lower_bound", seed=0)
    args = dict(zip(("q", "k", "v", "g", "beta"), case.tensors()))
    kw = case.kwargs()
    args.update(kw)
    args.update(over)
    return args


T_, H_, HV_, K_, V_ = 20, 2, 4, 16, 16
BAD = [
    ("q rank", dict(q=torch.randn(T_, H_, K_)), ValueError, "`q`"),
    ("k shape", dict(k=torch.randn(1, T_, H_, K_ + 1)), ValueError, "`k`"),
    ("v shape", dict(v=torch.randn(1, T_ + 1, HV_, V_)), ValueError, "`v`"),
    ("g shape", dict(g=torch.randn(1, T_, HV_, K_ - 1)), ValueError, "`g`"),
    ("beta shape", dict(beta=torch.randn(1, T_, HV_, 1)), ValueError, "`beta`"),
    ("q not a tensor", dict(q=[1.0]), TypeError, "`q`"),
    ("k dtype", dict(k=torch.randn(1, T_, H_, K_, dtype=torch.float16)), TypeError, "`k`"),
    ("v dtype", dict(v=torch.randn(1, T_, HV_, V_, dtype=torch.float64)), TypeError, "`v`"),
    ("g dtype", dict(g=torch.zeros(1, T_, HV_, K_, dtype=torch.int32)), TypeError, "`g`"),
    ("q int", dict(q=torch.ones(1, T_, H_, K_, dtype=torch.int64)), TypeError, "`q`"),
    ("device", dict(beta=torch.randn(1, T_, HV_, device="meta")), ValueError, "`beta`"),
    # (the four cases below: branches a mutation audit of 2026-12-05 found no case reaching)
    ("beta dtype", dict(beta=torch.zeros(1, T_, HV_, dtype=torch.int32)), TypeError, "`beta`"),
    ("initial_state device", dict(initial_state=torch.randn(1, HV_, K_, V_, device="meta")), ValueError,
     "`initial_state`"),
    ("HV % H", dict(
        v=torch.randn(1, T_, 3, V_), g=torch.randn(1, T_, 3, K_), beta=torch.randn(1, T_, 3),
        initial_state=None, A_log=torch.rand(3), dt_bias=torch.rand(3 * K_),
    ), ValueError, "HV=3"),
    ("K > 256", dict(
        q=torch.randn(1, T_, H_, 257), k=torch.randn(1, T_, H_, 257), g=torch.randn(1, T_, HV_, 257),
        initial_state=None, dt_bias=None,
    ), ValueError, "K=257"),
    ("V > 256", dict(v=torch.randn(1, T_, HV_, 300), initial_state=None), ValueError, "V=300"),
    ("head_first", dict(head_first=True), ValueError, "`head_first"),
    ("cu_seqlens int16", dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int16)), TypeError, "int64 or int32"),
    ("cu_seqlens_cpu disagrees", dict(cu_seqlens=torch.tensor([0, 8, 20]), cu_seqlens_cpu=torch.tensor([0, 12, 20])),
     ValueError, "disagrees with `cu_seqlens`"),
    ("cu_seqlens_cpu shape", dict(cu_seqlens=torch.tensor([0, 20]), cu_seqlens_cpu=torch.tensor([0, 8, 20])),
     ValueError, "`cu_seqlens_cpu`"),
    ("cu_seqlens 2-D", dict(cu_seqlens=torch.tensor([[0, 20]])), ValueError, "`cu_seqlens`"),
    ("cu_seqlens start", dict(cu_seqlens=torch.tensor([1, 20])), ValueError, "start at 0"),
    ("cu_seqlens decreasing", dict(cu_seqlens=torch.tensor([0, 12, 8, 20])), ValueError, "non-decreasing"),
    ("cu_seqlens decreasing first", dict(cu_seqlens=torch.tensor([0, -4, 20])), ValueError, "non-decreasing"),
    ("cu_seqlens end", dict(cu_seqlens=torch.tensor([0, 21])), ValueError, "end at most at T"),
    ("cu_seqlens with B=2", dict(
        q=torch.randn(2, 10, H_, K_), k=torch.randn(2, 10, H_, K_), v=torch.randn(2, 10, HV_, V_),
        g=torch.randn(2, 10, HV_, K_), beta=torch.randn(2, 10, HV_), cu_seqlens=torch.tensor([0, 10]),
    ), ValueError, "batch size must be 1"),
    ("initial_state shape", dict(initial_state=torch.randn(2, HV_, K_, V_)), ValueError, "`initial_state`"),
    ("initial_state dtype", dict(initial_state=torch.randn(1, HV_, K_, V_, dtype=torch.float16)), TypeError, "`initial_state`"),
    ("final_state_dtype", dict(final_state_dtype=torch.float16), TypeError, "`final_state_dtype`"),
    ("final_state_dtype not a dtype", dict(final_state_dtype="bf16"), TypeError, "`final_state_dtype`"),
    ("initial_state layout", dict(initial_state=torch.randn(1, HV_, K_, V_ + 1), state_v_first=True), ValueError, "[N, HV, V, K]"),
    ("lower_bound < -5", dict(lower_bound=-6.0), ValueError, "`lower_bound`"),
    ("lower_bound >= 0", dict(lower_bound=0.0), ValueError, "`lower_bound`"),
    ("lower_bound 0 unsafe", dict(lower_bound=0.0, safe_gate=False), ValueError, "finite negative"),
    ("safe gate without lb", dict(lower_bound=None), ValueError, "`lower_bound`"),
    ("A_log missing", dict(A_log=None, lower_bound=None, safe_gate=False), ValueError, "`A_log`"),
    ("A_log shape", dict(A_log=torch.rand(HV_ + 1)), ValueError, "`A_log`"),
    ("dt_bias shape", dict(dt_bias=torch.rand(HV_ * K_ + 1)), ValueError, "`dt_bias`"),
    # (taken and cast until a review of 2026-12-07: complex lost its imaginary part with a warning)
    ("A_log complex", dict(A_log=torch.rand(HV_, dtype=torch.complex64)), TypeError, "`A_log` must be a floating"),
    ("A_log int", dict(A_log=torch.ones(HV_, dtype=torch.int64)), TypeError, "`A_log` must be a floating"),
    ("dt_bias bool", dict(dt_bias=torch.ones(HV_ * K_, dtype=torch.bool)), TypeError, "`dt_bias` must be a floating"),
    ("neg eigval without sigmoid", dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False), ValueError, "`allow_neg_eigval"),
    ("intermediate states", dict(return_intermediate_states=True), ValueError, "`return_intermediate_states"),
    ("scale", dict(scale=float("nan")), TypeError, "`scale`"),
    # integers past the float range (OverflowError from float() until a review of 2026-12-07)
    ("scale past float", dict(scale=10**400), TypeError, "`scale`"),
    ("lower_bound past float", dict(lower_bound=-(10**400), safe_gate=False), ValueError, "`lower_bound`"),
    ("unknown kwarg", dict(use_grpah=True), TypeError, "use_grpah"),
    ("backend name", dict(backend="fast"), ValueError, "`backend`"),
]  # fmt: skip


def test_numpy_scalars_are_taken_as_floats():
    """scale and lower_bound as numpy scalars of any float width (np.float32 was refused while
    np.float64, a float subclass, was taken, until a review of 2026-12-07): the same answer as
    Python floats."""
    import numpy as np

    import kda

    args = base(safe_gate=False)
    want = kda.chunk_kda(**args, scale=0.3)
    for cast in (np.float32, np.float64, np.float16):
        got = kda.chunk_kda(**base(safe_gate=False, lower_bound=cast(-4.0)), scale=cast(0.3))
        ref = kda.chunk_kda(**base(safe_gate=False, lower_bound=float(cast(-4.0))), scale=float(cast(0.3)))
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), cast
    assert not torch.equal(want[0], kda.chunk_kda(**args, scale=0.5)[0])


def test_int32_cu_seqlens_equal_int64():
    """flash-attn users hold int32 offsets: taken as they are (device copy and host copy), the
    same answer as int64."""
    import kda
    from helpers import make_case

    case = make_case(seq_lens=[5, 0, 21], H=1, K=8, V=8, seed=4)
    kw = case.kwargs()
    want = kda.chunk_kda(*case.tensors(), backend="torch", **kw)
    for host in (None, case.cu_seqlens.int()):
        kw32 = dict(kw, cu_seqlens=case.cu_seqlens.int(), cu_seqlens_cpu=host)
        got = kda.chunk_kda(*case.tensors(), backend="torch", **kw32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name,over,exc,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected(name, over, exc, needle):
    args = base(**over)
    h0 = args.get("initial_state")
    before = None if h0 is None else h0.clone()
    with pytest.raises(exc) as info:
        kda.chunk_kda(**args)
    assert needle in str(info.value), f"message does not name {needle}: {info.value}"
    if h0 is not None and h0.device.type != "meta":  # (meta tensors hold no values to compare)
        assert torch.equal(h0, before), "a caller tensor was modified"


def test_a_0d_dt_bias_is_refused_by_name():
    """HV * K = 1: a 0-d dt_bias has the right element count but no shape to read a K from."""
    case = make_case(T=5, H=1, HV=1, K=1, V=4, gate="lower_bound", seed=1)
    with pytest.raises(ValueError, match="`dt_bias`"):
        kda.chunk_kda(*case.tensors(), **case.kwargs(dt_bias=torch.tensor(0.5)))


def test_fused_recurrent_validates_too():
    args = base(q=torch.randn(T_, H_, K_))
    args.pop("safe_gate")
    with pytest.raises(ValueError, match="`q`"):
        kda.fused_recurrent_kda(**args)


def test_transpose_state_layout_alias():
    args = base(backend="torch")
    h0 = args.pop("initial_state")
    args.pop("state_v_first")
    with pytest.warns(DeprecationWarning, match="transpose_state_layout") as caught:
        o, ht = kda.chunk_kda(**args, initial_state=h0.transpose(-1, -2).contiguous(), transpose_state_layout=True)
    assert caught[0].filename == __file__, "the warning should point at the caller of chunk_kda"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2, ht2 = kda.chunk_kda(**args, initial_state=h0.transpose(-1, -2).contiguous(), state_v_first=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        kda.chunk_kda(**args, initial_state=h0, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_problem_sizes_are_those_of_the_tensors(varlen, state_v_first):
    """Backends read the sizes from the Problem's fields, filled once while checking."""
    from kda.api import checked_problem

    seq = dict(seq_lens=[5, 0, 11]) if varlen else dict(B=2, T=7)
    case = make_case(**seq, H=2, HV=4, K=16, V=8, state_v_first=state_v_first, seed=0)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    B, T, H, K = case.q.shape
    N = 3 if varlen else B
    assert (p.B, p.T, p.H, p.K, p.HV, p.V, p.N) == (B, T, H, K, 4, 8, N)
    assert p.state_shape == ((N, 4, 8, K) if state_v_first else (N, 4, K, 8))
    assert p.state_shape == case.initial_state.shape and p.gate_form == "lower_bound"
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(use_gate_in_kernel=False))
    assert p.gate_form == "precomputed"
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(lower_bound=None, safe_gate=False))
    assert p.gate_form == "softplus"


@pytest.mark.parametrize("chunk_size, ok", [(32, True), (64, True), (16, False), (17, False)])
def test_chunk_size_is_ignored_but_checked_as_fla_checks_it(chunk_size, ok):
    """fla's chunk_kda takes chunk_size 32 or 64 and refuses the rest; kda ignores it (its chunks
    are 16 tokens) but refuses what fla refuses, so a call valid on one is valid on the other."""
    args = base(backend="torch")
    if ok:
        kda.chunk_kda(**args, chunk_size=chunk_size)
    else:
        with pytest.raises(ValueError, match="`chunk_size`"):
            kda.chunk_kda(**args, chunk_size=chunk_size)


def test_checking_leaves_the_callers_keyword_arguments_alone():
    """check_chunk_kda reads fla's extra keyword arguments without popping them: a dict reused
    across calls (as checked_problem's callers and the benchmarks do) checks the same each time."""
    from kda import validation

    args = base(backend="torch")
    args.pop("backend")
    extra = {name: args.pop(name) for name in ("A_log", "dt_bias")} | {"chunk_size": 64, "head_first": False}
    args |= dict(return_intermediate_states=False, disable_recompute=False, cu_seqlens_cpu=None)
    args |= dict(final_state_dtype=None, scale=None, allow_neg_eigval=False, cu_seqlens=None)
    before = dict(extra)
    first = validation.check_chunk_kda(args, extra)
    assert extra == before
    again = validation.check_chunk_kda(args, extra)
    assert again.A_log is not None and torch.equal(again.A_log, first.A_log)


def test_fused_recurrent_ignores_chunk_kdas_own_flags_as_fla_does():
    """fla's fused_recurrent_kda swallows chunk_kda's chunk flags in its **kwargs, so one dict of
    keywords serves both functions; refused as unknown until a review of 2026-12-07. Other
    unknown names stay refused, and chunk_kda still checks its own."""
    case = make_case(T=9, H=1, K=8, V=8, gate="lower_bound", seed=5)
    kw = {key: value for key, value in case.kwargs().items() if key != "safe_gate"}
    want = kda.fused_recurrent_kda(*case.tensors(), backend="torch", **kw)
    flags = dict(safe_gate=True, disable_recompute=True, return_intermediate_states=True)
    got = kda.fused_recurrent_kda(*case.tensors(), backend="torch", **kw, **flags)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match="unexpected keyword argument.*: safe_gat"):
        kda.fused_recurrent_kda(*case.tensors(), **kw, safe_gat=True)
    with pytest.raises(ValueError, match="return_intermediate_states"):
        kda.chunk_kda(*case.tensors(), **case.kwargs(), return_intermediate_states=True)


def test_lower_bound_without_the_gate_in_kernel_is_ignored_as_fla_ignores_it():
    case = make_case(T=9, H=1, K=8, V=8, gate="precomputed", seed=6)
    want = kda.chunk_kda(*case.tensors(), **case.kwargs())
    for lower_bound in (0.0, -7.0):
        got = kda.chunk_kda(*case.tensors(), **case.kwargs(), lower_bound=lower_bound)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), lower_bound
    with pytest.raises(TypeError, match="`lower_bound`"):
        kda.chunk_kda(*case.tensors(), **case.kwargs(), lower_bound="-1")


def test_gate_dtype_error_names_each_dtype_once():
    case = make_case(T=9, H=1, K=8, V=8, gate="precomputed", seed=7)
    q, k, v, g, beta = case.tensors()
    with pytest.raises(TypeError) as info:
        kda.chunk_kda(q, k, v, g.half(), beta, **case.kwargs())
    assert "must be torch.float32 or torch.float64 (" in str(info.value), info.value
