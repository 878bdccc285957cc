"""The CUDA backend's host side, on any machine: the driver is stood in for, so these check
what the Python hands the driver (launch arguments in order, the Params block field by field)
rather than what the kernels do with it (tests/test_cuda.py, on a Hopper GPU)."""

import ctypes
import itertools
from types import SimpleNamespace

import pytest
import torch

import kda
from helpers import make_case
from kda import abi, dispatch, tables
from kda.api import checked_problem
from kda.cuda import forward, loader
from kda.tables import chunk_tables

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
OK = driver.CUresult.CUDA_SUCCESS
# CUresult cuLaunchKernel(CUfunction, 7 x unsigned int, CUstream, void **kernelParams, void **extra)
LAUNCH_PROTOTYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)


class FakeLibcuda:
    """A C function with cuLaunchKernel's signature that records its arguments and the Params
    block they point to, called like ``loader.driver_launch()``'s libcuda function (a ctypes
    function without argtypes at its address), so the arguments take the same conversions."""

    def __init__(self, status: int = 0, block: type = loader.Params):
        self.calls = []
        self.status = status
        self.block = block  # the parameter block the launches pass (loader.DecodeParams for decode)
        self.second_block = None  # (kernel handle, []): that kernel's second blocks are recorded too
        self.c_function = LAUNCH_PROTOTYPE(self.record)  # kept alive while the fake is used
        self.launch = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(self.c_function, ctypes.c_void_p).value)

    def record(self, *args):
        argument_array = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
        params = self.block.from_address(argument_array[0])
        self.calls.append((args, self.block.from_buffer_copy(params)))
        if self.second_block is not None and args[0] == self.second_block[0]:  # a launch of two blocks
            self.second_block[1].append(self.block.from_buffer_copy(self.block.from_address(argument_array[1])))
        return self.status


@pytest.fixture(autouse=True)
def fresh_workspaces(monkeypatch):
    """Each test starts with no kept stream workspaces (nor time blocks' tables) and leaves none behind."""
    monkeypatch.setattr(forward, "_workspaces", {})
    monkeypatch.setattr(forward, "_block_tables", {})


@pytest.fixture
def load_kernels(monkeypatch, tmp_path):
    """``load_kernels(launch)``: a loader.Kernels over empty files, with the driver calls of
    loading answered here and ``launch`` in place of libcuda's cuLaunchKernel (None: cuda-bindings)."""
    handles = itertools.count(0x1000, 0x100)
    for name, stub in {
        "cuInit": lambda flags: (OK,),
        "cuLibraryLoadData": lambda *args: (OK, driver.CUlibrary(0x10)),
        "cuLibraryGetKernel": lambda library, name: (OK, driver.CUkernel(next(handles))),
        "cuDeviceGet": lambda index: (OK, driver.CUdevice(index)),
        "cuKernelSetAttribute": lambda *args: (OK,),
        "cuCtxGetCurrent": lambda: (OK, driver.CUcontext(0x77)),
    }.items():
        monkeypatch.setattr(driver, name, stub)
    for artefact in loader.ARTEFACTS:
        (tmp_path / artefact).write_bytes(b"")

    def load(launch):
        monkeypatch.setattr(loader, "driver_launch", lambda: launch)
        return loader.Kernels(tmp_path)

    return load


def fake_device(load_kernels, monkeypatch, block: type = loader.Params) -> tuple[FakeLibcuda, object]:
    """``(libcuda, kernels)``: launches recorded by a FakeLibcuda (for ``block``), device 0
    current, its current stream 0x5000: what the launch tests below stand on."""
    libcuda = FakeLibcuda(block=block)
    kernels = load_kernels(libcuda.launch)
    monkeypatch.setattr(loader, "kernels", lambda: kernels)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "_current_device", None)
    monkeypatch.setattr(forward, "_current_raw_stream", lambda index: 0x5000 + index)
    return libcuda, kernels


def test_kernels_missing_an_entry_point_say_rebuild(load_kernels, monkeypatch):
    """A fatbin without one of this package's entry points (kernels built from older sources:
    the stamp covers the ABI header, not the entry points, 2026-12-07) is refused with the file,
    the entry point and what to do, not the driver's bare NOT_FOUND."""
    missing = loader.abi.decode_kernel_name("bfloat16", False, 128, "float32")
    real = driver.cuLibraryGetKernel

    def get_kernel(library, name):
        return (driver.CUresult.CUDA_ERROR_NOT_FOUND, None) if name == missing.encode() else real(library, name)

    monkeypatch.setattr(driver, "cuLibraryGetKernel", get_kernel)
    monkeypatch.setattr(driver, "cuGetErrorString", lambda err: (OK, b"named symbol not found"))
    with pytest.raises(loader.CudaError, match=f"decode.fatbin has no entry point {missing}: .*rebuild"):
        load_kernels(None)


def test_direct_launch_passes_the_driver_arguments_in_order(load_kernels):
    libcuda = FakeLibcuda()
    kernels = load_kernels(libcuda.launch)
    name = next(iter(kernels.kernels))
    kernels.launch(name, (7, 3), 128, 4096, 0x5000)
    ((args, _),) = libcuda.calls
    handle = int(kernels.kernels[name])
    assert args == (handle, 7, 3, 1, 128, 1, 1, 4096, 0x5000, ctypes.addressof(kernels.argument_array), None)


def test_failed_direct_launch_raises_with_the_driver_text(load_kernels, monkeypatch):
    monkeypatch.setattr(driver, "cuGetErrorString", lambda error: (OK, b"invalid argument"))
    libcuda = FakeLibcuda(status=int(driver.CUresult.CUDA_ERROR_INVALID_VALUE))  # alive: it owns the C callback
    kernels = load_kernels(libcuda.launch)
    name = next(iter(kernels.kernels))
    with pytest.raises(loader.CudaError, match=f"launching {name} failed: CUDA_ERROR_INVALID_VALUE: invalid argument"):
        kernels.launch(name, (1, 1), 32, 0, 0)


def test_launch_goes_through_cuda_bindings_without_libcuda(load_kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: calls.append(args) or (OK,))
    kernels = load_kernels(None)
    name = next(iter(kernels.kernels))
    kernels.launch(name, (7, 3), 128, 4096, 0x5000)
    assert calls == [
        (kernels.kernels[name], 7, 3, 1, 128, 1, 1, 4096, 0x5000, ctypes.addressof(kernels.argument_array), 0)
    ]


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("h0_dtype, ht_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize("g_dtype, beta_dtype", [(F32, BF16), (BF16, F32)])
def test_chunk_forward_fills_the_params_block_field_by_field(
    load_kernels, monkeypatch, h0_dtype, ht_dtype, g_dtype, beta_dtype
):
    """The Params block is packed positionally (one struct.pack_into); every field must land
    under its own name, for both launches, on the current device's current stream. The state
    dtypes in and out and the gate inputs' dtypes differ here, so a flag or a final state
    taken from the wrong one shows (a mutation audit of 2026-12-05 found both passing when
    they were always equal), and K2's block is the 2k2 width's (its ksplit counted)."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    built = []  # varlen tables are built per call: keep the ones the launch was given
    monkeypatch.setattr(forward, "chunk_tables", lambda p, *args: built.append(chunk_tables(p, *args)) or built[-1])
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    case.initial_state = case.initial_state.to(h0_dtype)
    case.g, case.beta = case.g.to(g_dtype), case.beta.to(beta_dtype)
    kw = case.kwargs(state_v_first=True, final_state_dtype=ht_dtype)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    o, ht = forward.chunk_forward(p)
    assert ht.dtype == ht_dtype and ht.shape == p.state_shape

    (prepare_args, prm), (recurrence_args, prm_again) = libcuda.calls
    assert bytes(prm) == bytes(prm_again)
    (tables,) = built
    assert tables.chunk_offsets.tolist() == [0, 2, 3]
    pointers = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, A_log=p.A_log, dt_bias=p.dt_bias, h0=p.initial_state)
    pointers |= dict(ht=ht, o=o, seq_offsets=tables.seq_offsets, chunk_offsets=tables.chunk_offsets)
    pointers |= dict(chunk_seq=tables.chunk_seq, seq_order=tables.seq_order)
    assert {name: getattr(prm, name) for name in pointers} == {
        name: 0 if x is None else x.data_ptr() for name, x in pointers.items()
    }
    flags = loader.FLAGS
    expected_flags = flags["gate_lower_bound"] | flags["has_h0"] | flags["store_ht"]
    expected_flags |= flags["has_A_log"] if p.A_log is not None else 0
    expected_flags |= flags["has_dt_bias"] if p.dt_bias is not None else 0
    expected_flags |= flags["state_v_first"] if p.state_v_first else 0
    expected_flags |= flags["g_float32"] if p.g.dtype == torch.float32 else 0
    expected_flags |= flags["beta_float32"] if p.beta.dtype == torch.float32 else 0
    expected_flags |= flags["l2norm"] if p.use_qk_l2norm else 0
    expected_flags |= flags["beta_sigmoid"] if p.use_beta_sigmoid else 0
    expected_flags |= flags["h0_bfloat16"] if h0_dtype == BF16 else 0
    expected_flags |= flags["ht_bfloat16"] if ht_dtype == BF16 else 0
    assert (prm.num_chunks, prm.num_seqs, prm.heads, prm.flags) == (tables.num_chunks, 2, 2, expected_flags)
    assert (prm.scale, prm.lower_bound, prm.beta_scale) == (p.scale, p.lower_bound, 2.0 if p.allow_neg_eigval else 1.0)
    assert prm.workspace == forward._workspaces[-1, 0x5000].data_ptr()  # kept for the stream
    assert prepare_args[1:3] == (tables.num_chunks, 2) and prepare_args[8] == 0x5000
    assert recurrence_args[8] == 0x5000
    assert recurrence_args[1:3] == (4 * 2 * 2, 1)  # two warps for 4 pairs: 4 V slices of 32 a pair
    # 2k2: two V groups of two consumer warps each, and the producer warp
    assert recurrence_args[4:8] == (32 * (2 * 2 + 1), 1, 1, abi.recurrence_shared_bytes(2, 2))


@pytest.mark.parametrize(
    "gate, lower_bound, far",
    [("lower_bound", -5.0, False), ("lower_bound", -5.025, False), ("lower_bound", -5.026, True),
     ("lower_bound", -8.0, True), ("precomputed", None, True)],
)  # fmt: skip
def test_forward_and_backward_launch_the_prepare_entry_point_the_gate_needs(
    load_kernels, monkeypatch, gate, lower_bound, far
):
    """kda_prepare (six CTAs an SM, ki over the g tile) has no per-row test of a decay past
    2^-EXP2_LIMIT: only a lower-bound gate whose 16 steps of lb cannot get there may take it
    (lb >= -5.0253); any steeper lb or a precomputed g takes kda_prepare_far, in the forward and in
    the training backward's K1."""
    from kda import abi
    from kda.cuda import training

    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate=gate, seed=4)
    kw = case.kwargs(state_v_first=True)
    if lower_bound is not None:
        kw.update(lower_bound=lower_bound, safe_gate=lower_bound >= abi.SAFE_LOWER_BOUND_MIN)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    forward.chunk_forward(p)
    training.state_grad_chain(p, torch.randn(p.v.shape).to(torch.bfloat16), None, torch.empty(p.state_shape),
                              torch.empty(3, 2, 128, 128, dtype=torch.bfloat16))  # fmt: skip
    want = int(kernels.kernels[abi.PREPARE_FAR_KERNEL if far else abi.PREPARE_KERNEL])
    launched = [args[0] for args, _ in libcuda.calls]
    assert len(launched) == 4 and launched[0] == launched[2] == want, launched
    assert want not in (launched[1], launched[3])


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False)])
def test_far_entry_points_twin_is_on_unless_the_switch_says_0(switches, value, on):
    """KDA_CUDA_FAR_WGMMA as read_switches reads it: on when unset (the default since run 168,
    2026-12-05) or 1, off at 0 (the switch's routing: the test below)."""
    switches("KDA_CUDA_FAR_WGMMA", value)
    assert kda.cuda.FAR_WGMMA is on


@pytest.mark.parametrize(
    "H, lower_bound, checkpoints, override, far_wgmma, want",
    [(64, -5.0, False, None, False, 1), (96, -5.0, False, None, False, 2), (600, -5.0, False, None, False, 2),
     (59, -5.0, False, None, False, 0), (60, -5.0, False, None, False, 1), (64, -8.0, False, None, False, 0),
     (64, -5.0, True, None, False, 0), (64, -5.0, False, "mma", False, 0), (64, -5.0, False, "2", False, 0),
     (2, -5.0, False, "wgmma2", False, 2), (2, -5.0, False, "wgmma1", False, 1), (2, -8.0, False, "wgmma1", False, 0),
     (96, -5.0, True, "wgmma2", False, 0), (64, None, False, None, False, 0),
     # KDA_CUDA_FAR_WGMMA=1: the far entry point's gates (lb < -5.025, a precomputed g) by the same rule
     (64, -8.0, False, None, True, 1), (96, None, False, None, True, 2), (59, None, False, None, True, 0),
     (2, -8.0, False, "wgmma1", True, 1), (96, None, True, None, True, 0), (64, -5.0, False, None, True, 1)],
)  # fmt: skip
def test_wgmma_recurrence_by_the_rule_and_the_switch(load_kernels, monkeypatch, H, lower_bound, checkpoints, override,
                                                     far_wgmma, want):  # fmt: skip
    """forward.recurrence_kind on 132 SMs, and what the forward hands the driver for it: where
    two CTAs a (sequence, head) pair fill 90% of the SMs (119 CTAs: H >= 60 for one sequence),
    K1's twin that stores its tiles for wgmma (kda_prepare_wgmma), then the wgmma K2 at one CTA
    an SM up to a wave and two past it (its grid, 160 threads, its shared memory), and the
    dispatch log says so; never for K1's far entry point (lb < -5.025, or a precomputed g:
    lower_bound None here) unless KDA_CUDA_FAR_WGMMA=1, which gives it its own twin
    (kda_prepare_far_wgmma); never with training checkpoints, which it does not write;
    KDA_CUDA_WARPS forces either kind."""
    from kda.triton.training import checkpoint_shape

    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", override)
    monkeypatch.setattr(kda.cuda, "FAR_WGMMA", far_wgmma)
    gate = "lower_bound" if lower_bound is not None else "precomputed"
    case = make_case(seq_lens=[20], H=H, K=128, V=128, dtype=torch.bfloat16, gate=gate, seed=4)
    kw = case.kwargs()
    if lower_bound is not None:
        kw.update(lower_bound=lower_bound, safe_gate=lower_bound >= abi.SAFE_LOWER_BOUND_MIN)
    far = lower_bound is None or lower_bound < -5.0
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    with kda.record_dispatch() as events:
        forward.chunk_forward(p, torch.empty(checkpoint_shape(p)) if checkpoints else None)
    names = {int(handle): name for name, handle in kernels.kernels.items()}
    (k1_args, _), (k2_args, block) = libcuda.calls
    k1, k2 = names[k1_args[0]], names[k2_args[0]]
    assert events[:2] == ["cuda:prepare", "cuda:recurrence"], events
    if want:
        twin = abi.PREPARE_FAR_WGMMA_KERNEL if far else abi.PREPARE_WGMMA_KERNEL
        assert (k1, k2) == (twin, abi.wgmma_kernel_name(want))
        assert k2_args[1:8] == (2 * H, 1, 1, abi.WGMMA_THREADS, 1, 1, abi.wgmma_shared_bytes(want))
        assert events[2:] == [f"cuda:recurrence:wgmma{want}"], events
    else:
        assert k1 == (abi.PREPARE_FAR_KERNEL if far else abi.PREPARE_KERNEL), k1
        assert k2.startswith("kda_recurrence_w") and not k2.startswith("kda_recurrence_wgmma"), k2
        assert events[2:] == [], events
    assert bool(block.flags & forward.FLAG_STORE_CHECKPOINTS) == checkpoints


def test_shared_runs_launch_k1_once_and_k2_for_each_call(load_kernels, monkeypatch):
    """kda.cuda.forward.chunk_forward_runs (the segment split's transition runs): K1 once, with
    the first call's block, then K2 for every call with its own v, states and outputs and the same
    workspace and tables; the dispatch log shows one prepare and a recurrence a call."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    kw = case.kwargs(output_final_state=True)
    q, k, v, g, beta = case.tensors()
    runs = [(v, torch.zeros(case.initial_state.shape)), (torch.zeros_like(v), torch.randn(case.initial_state.shape))]
    problems = [
        checked_problem(kda.chunk_kda, q, k, v_run, g, beta, **(kw | dict(initial_state=h0))) for v_run, h0 in runs
    ]
    with kda.record_dispatch() as events:
        results = forward.chunk_forward_runs(problems, v_zero=[False, True])
    assert events == ["cuda:prepare", "cuda:recurrence", "cuda:recurrence"], events
    (prepare_args, first), (_, first_again), (recurrence_args, second) = libcuda.calls
    assert prepare_args[0] == int(kernels.kernels["kda_prepare"]) and recurrence_args[0] != prepare_args[0]
    assert bytes(first) == bytes(first_again)
    for block, (v_run, h0), (o, ht) in zip((first, second), runs, results):
        assert (block.v, block.h0, block.o, block.ht) == (v_run.data_ptr(), h0.data_ptr(), o.data_ptr(), ht.data_ptr())
    assert (second.workspace, second.chunk_offsets) == (first.workspace, first.chunk_offsets)
    # a workspace of the call's own: the stream's kept one could be refilled between the runs
    assert all(kept.data_ptr() != first.workspace for kept in forward._workspaces.values())
    assert (second.q, second.k, second.g, second.beta) == (first.q, first.k, first.g, first.beta)
    # the second run's v is zeros, which its K2 takes without reading v: the bit is in its block only
    assert not first.flags & forward.FLAG_V_ZERO and second.flags == first.flags | forward.FLAG_V_ZERO


@pytest.mark.parametrize("warps, ctas", [(None, 2), ("wgmma1", 1)])
def test_wgmma_runs_go_in_one_launch_of_two_blocks(load_kernels, monkeypatch, warps, ctas):
    """The split's two transition runs where K2 is the wgmma one (forward.runs_kind): K1 once, for
    the wgmma tiles, then one K2 launch of both runs' Params blocks, its grid twice a run's (two
    CTAs an SM past a wave, or as KDA_CUDA_WARPS says); the log says so. With
    KDA_CUDA_PAIRED_RUNS=0, a launch a run."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", warps)
    case = make_case(seq_lens=[4096, 100] * 16, H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=5)
    kw = case.kwargs(output_final_state=True)
    q, k, v, g, beta = case.tensors()
    runs = [(v, torch.zeros(case.initial_state.shape)), (v, torch.randn(case.initial_state.shape))]
    problems = [
        checked_problem(kda.chunk_kda, q, k, v_run, g, beta, **(kw | dict(initial_state=h0))) for v_run, h0 in runs
    ]
    name = abi.wgmma_runs_kernel_name(ctas)
    libcuda.second_block = (int(kernels.kernels[name]), [])
    pairs = 32 * 2
    assert 2 * forward.chain_grid(4, pairs) >= 0.9 * 132  # the wgmma K2 by the rule at 132 SMs
    with kda.record_dispatch() as events:
        results = forward.chunk_forward_runs(problems, v_zero=[False, True])
    assert events == ["cuda:prepare", "cuda:recurrence:runs", f"cuda:recurrence:wgmma{ctas}"], events
    (prepare_args, _), (runs_args, first) = libcuda.calls
    assert prepare_args[0] == int(kernels.kernels[abi.PREPARE_WGMMA_KERNEL])
    assert runs_args[0] == int(kernels.kernels[name])
    grid = 2 * forward.chain_grid(4, pairs)
    assert runs_args[1:8] == (grid, 1, 1, abi.WGMMA_THREADS, 1, 1, abi.wgmma_shared_bytes(ctas))
    (second,) = libcuda.second_block[1]
    for block, (v_run, h0), (o, ht) in zip((first, second), runs, results):
        assert (block.v, block.h0, block.o, block.ht) == (v_run.data_ptr(), h0.data_ptr(), o.data_ptr(), ht.data_ptr())
    assert (second.workspace, second.seq_order, second.q) == (first.workspace, first.seq_order, first.q)
    assert not first.flags & forward.FLAG_V_ZERO and second.flags == first.flags | forward.FLAG_V_ZERO
    monkeypatch.setattr(kda.cuda, "PAIRED_RUNS", False)
    libcuda.calls.clear()
    with kda.record_dispatch() as events:
        forward.chunk_forward_runs(problems, v_zero=[False, True])
    alone = forward.recurrence_kind(problems[0], 132, False)  # a run's grid: 128 CTAs, one an SM by the rule
    assert events == ["cuda:prepare", *(["cuda:recurrence", f"cuda:recurrence:wgmma{alone}"] * 2)], events


class FakeStream:
    """A torch stream as forward.stream_pair hands it out: its handle, and its waits logged with
    the launches made when the awaited event was recorded and when the wait was queued
    (``("wait", waiter, signaller, launches at the record, launches at the wait)``)."""

    def __init__(self, handle: int, log: list, libcuda: FakeLibcuda):
        self.cuda_stream, self.log, self.libcuda = handle, log, libcuda

    def record_event(self) -> tuple[int, int]:
        return self.cuda_stream, len(self.libcuda.calls)

    def wait_event(self, event: tuple[int, int]) -> None:
        self.log.append(("wait", self.cuda_stream, *event, len(self.libcuda.calls)))

    def wait_stream(self, other: "FakeStream") -> None:
        self.wait_event(other.record_event())


@pytest.mark.parametrize(
    "state_dtype, warps, lower_bound, far_wgmma",
    [(torch.float32, None, -5.0, False), (torch.bfloat16, None, -5.0, False), (torch.float32, "mma", -5.0, False),
     (torch.float32, None, -8.0, False), (torch.float32, None, -8.0, True), (torch.float32, "mma", -8.0, True)],
)  # fmt: skip
def test_time_blocks_launch_k1_on_the_stream_and_k2_beside_it_in_order(
    load_kernels, monkeypatch, state_dtype, warps, lower_bound, far_wgmma
):
    """KDA_CUDA_BLOCKS=3 on 100 tokens: blocks of 48, 48 and 4 tokens. K1 of every block on the
    current stream, an event after each; then for each block the recurrence stream waits for its
    K1's event and runs its K2; the current stream waits for the recurrence stream last. Each
    block's Params hold its slice of every input and of o, its own part of one workspace, the
    state the block before wrote (the caller's for the first) and the next block's state (the
    caller's final state for the last). Every block's K2 is the wgmma one at one CTA an SM
    (forward.recurrence_kind's ``blocked``) after K1's twin that stores its tiles for it, although
    two CTAs a pair would not fill the GPU here; KDA_CUDA_WARPS=mma or a gate past kda_prepare's
    (lb < -5.025) keep the mma.sync K2, the latter unless KDA_CUDA_FAR_WGMMA=1 (then K1's far
    entry point's twin)."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "3")
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", warps)
    monkeypatch.setattr(kda.cuda, "FAR_WGMMA", far_wgmma)
    wgmma = warps is None and (lower_bound >= -5.0 or far_wgmma)
    log = []
    streams = lambda index, stream, kernels: (FakeStream(stream, log, libcuda), FakeStream(0x6000, log, libcuda))  # noqa: E731
    monkeypatch.setattr(forward, "stream_pair", streams)
    builds = []
    build = forward.build_tables
    monkeypatch.setattr(forward, "build_tables", lambda part, *args: builds.append(part.T) or build(part, *args))
    case = make_case(B=1, T=100, H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=41)
    case.initial_state = case.initial_state.to(state_dtype)
    kw = case.kwargs(final_state_dtype=state_dtype, lower_bound=lower_bound, safe_gate=lower_bound >= -5.0)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **kw)
    with kda.record_dispatch() as events:
        o, ht = forward.chunk_forward(p)
    assert builds == [48, 4], "one table build a block length"
    k2_events = ["cuda:recurrence", "cuda:recurrence:wgmma1"] if wgmma else ["cuda:recurrence"]
    assert events == ["cuda:blocks:3", *["cuda:prepare"] * 3, *k2_events * 3], events
    assert log == [("wait", 0x6000, 0x5000, 1, 3), ("wait", 0x6000, 0x5000, 2, 4), ("wait", 0x6000, 0x5000, 3, 5),
                   ("wait", 0x5000, 0x6000, 6, 6)]  # fmt: skip
    k1_name = abi.PREPARE_WGMMA_TWINS[forward.prepare_kernel(p)] if wgmma else forward.prepare_kernel(p)
    assert k1_name == {(False, False): abi.PREPARE_KERNEL, (False, True): abi.PREPARE_WGMMA_KERNEL,
                       (True, False): abi.PREPARE_FAR_KERNEL, (True, True): abi.PREPARE_FAR_WGMMA_KERNEL}[
                           lower_bound < -5.0, wgmma]  # fmt: skip
    prepare = int(kernels.kernels[k1_name])
    names = {int(handle): name for name, handle in kernels.kernels.items()}
    for k2_args, _ in libcuda.calls[3:]:
        if wgmma:
            assert names[k2_args[0]] == abi.wgmma_kernel_name(1)
            want = (forward.chain_grid(4, p.H), 1, 1, abi.WGMMA_THREADS, 1, 1, abi.wgmma_shared_bytes(1))
            assert k2_args[1:8] == want
        else:
            assert names[k2_args[0]].startswith("kda_recurrence_w") and "wgmma" not in names[k2_args[0]]
    flags = loader.FLAGS
    state_bits = flags["h0_bfloat16"] if state_dtype == torch.bfloat16 else 0
    blocks = [(0, 3), (48, 3), (96, 1)]  # (first token, chunks)
    previous_ht = p.initial_state.data_ptr()
    workspace = None
    for i, (t0, chunks) in enumerate(blocks):
        (k1_args, k1), (k2_args, k2) = libcuda.calls[i], libcuda.calls[3 + i]
        assert bytes(k1) == bytes(k2)
        assert k1_args[0] == prepare and k1_args[1:3] == (chunks, 2) and k1_args[8] == 0x5000
        assert k2_args[0] != prepare and k2_args[8] == 0x6000
        for name, x, width in (("q", p.q, 2 * 128), ("k", p.k, 2 * 128), ("v", p.v, 2 * 128), ("g", p.g, 2 * 128),
                               ("beta", p.beta, 2), ("o", o, 2 * 128)):  # fmt: skip
            assert getattr(k1, name) == x.data_ptr() + t0 * width * x.element_size(), name
        assert (k1.num_chunks, k1.num_seqs, k1.heads) == (chunks, 1, 2)
        assert k1.seq_offsets != 0 and k1.chunk_offsets != 0
        assert k1.h0 == previous_ht, f"block {i} starts from the state block {i - 1} wrote"
        last = i == len(blocks) - 1
        assert (k1.ht == ht.data_ptr()) == last and k1.ht not in (k1.h0, p.initial_state.data_ptr())
        want = flags["has_h0"] | flags["store_ht"] | (state_bits if i == 0 else 0)
        want |= (flags["ht_bfloat16"] if state_dtype == torch.bfloat16 else 0) if last else 0
        assert k1.flags & (want | state_bits | flags["ht_bfloat16"] | flags["has_h0"] | flags["store_ht"]) == want
        if workspace is not None:
            assert k1.workspace == workspace + 3 * 2 * loader.WORKSPACE_BYTES, "each block its own part"
        workspace, previous_ht = k1.workspace, k1.ht
    assert len(libcuda.calls) == 6
    forward.chunk_forward(p)
    assert builds == [48, 4], "the tables are kept for the next call on the stream"


@pytest.mark.parametrize("H, ctas", [(33, 1), (66, 1), (67, 2), (96, 2)])
def test_time_blocks_of_many_heads_take_the_wgmma_k2_at_the_fill_rules_width(load_kernels, monkeypatch, H, ctas):
    """KDA_CUDA_BLOCKS forced on a sequence of many heads: the blocks' wgmma K2 runs at one CTA an
    SM while its grid (two CTAs a head) is one wave at most (132 SMs: up to 66 heads), at two past
    it, as forward.recurrence_kind's fill rule would, not in two waves of one."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "2")
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", None)
    streams = lambda index, stream, kernels: (FakeStream(stream, [], libcuda), FakeStream(0x6000, [], libcuda))  # noqa: E731
    monkeypatch.setattr(forward, "stream_pair", streams)
    case = make_case(B=1, T=40, H=H, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=45)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    with kda.record_dispatch() as events:
        forward.chunk_forward(p)
    assert events == [
        "cuda:blocks:2",
        "cuda:prepare",
        "cuda:prepare",
        *["cuda:recurrence", f"cuda:recurrence:wgmma{ctas}"] * 2,
    ]
    names = {int(handle): name for name, handle in kernels.kernels.items()}
    launched = [(names[args[0]], args[1], args[7]) for args, _ in libcuda.calls]
    k2 = (abi.wgmma_kernel_name(ctas), 2 * H, abi.wgmma_shared_bytes(ctas))
    assert [name for name, *_ in launched[:2]] == [abi.PREPARE_WGMMA_KERNEL] * 2 and launched[2:] == [k2, k2], launched


def test_time_blocks_join_the_streams_when_a_launch_fails(load_kernels, monkeypatch):
    """A launch that fails inside the blocks still leaves the current stream waiting for the
    recurrence stream (what was queued there must not be overtaken), and the error reaches the caller."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    libcuda.status = int(driver.CUresult.CUDA_ERROR_INVALID_VALUE)
    monkeypatch.setattr(driver, "cuGetErrorString", lambda error: (OK, b"invalid argument"))
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "3")
    log = []
    streams = lambda index, stream, kernels: (FakeStream(stream, log, libcuda), FakeStream(0x6000, log, libcuda))  # noqa: E731
    monkeypatch.setattr(forward, "stream_pair", streams)
    case = make_case(B=1, T=100, H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=42)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    with pytest.raises(loader.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        forward.chunk_forward(p)
    assert len(libcuda.calls) == 1 and log == [("wait", 0x5000, 0x6000, 1, 1)], log


def test_time_blocks_without_a_final_state_store_only_the_carries(load_kernels, monkeypatch):
    """output_final_state=False and no initial state: the first block reads no state, every block
    but the last stores its state for the next, the last stores none."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "3")
    streams = lambda index, stream, kernels: (FakeStream(stream, [], libcuda), FakeStream(0x6000, [], libcuda))  # noqa: E731
    monkeypatch.setattr(forward, "stream_pair", streams)
    case = make_case(B=1, T=100, H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", with_state=False, seed=43)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(output_final_state=False))
    o, ht = forward.chunk_forward(p)
    assert ht is None
    k1_blocks = [prm for args, prm in libcuda.calls[:3]]
    has_h0, store_ht = loader.FLAGS["has_h0"], loader.FLAGS["store_ht"]
    assert [(bool(b.flags & has_h0), bool(b.flags & store_ht)) for b in k1_blocks] == [
        (False, True),
        (True, True),
        (True, False),
    ]
    assert k1_blocks[0].h0 == 0 and k1_blocks[-1].ht == 0 and k1_blocks[1].h0 == k1_blocks[0].ht != 0


def test_recurrence_streams_are_kda_own_non_blocking_highest_priority_and_few(load_kernels, monkeypatch):
    """forward.stream_pair makes a stream through the driver (non-blocking, the context's greatest
    priority) for each (device, stream) the first time, keeps it, and past RECURRENCE_STREAMS
    answers None, where chunk_forward runs the call uncut, on the K2 its blocks would have taken
    (the wgmma one: the same bits as in blocks) after K1's twin that stores its tiles for it."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    monkeypatch.setattr(forward, "_recurrence_streams", {})
    monkeypatch.setattr(forward, "RECURRENCE_STREAMS", 2)
    created = []
    handles = itertools.count(0x9000)

    def create(flags, priority):
        created.append((flags, priority))
        return OK, driver.CUstream(next(handles))

    monkeypatch.setattr(driver, "cuCtxGetStreamPriorityRange", lambda: (OK, 0, -5))
    monkeypatch.setattr(driver, "cuStreamCreateWithPriority", create)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: SimpleNamespace(cuda_stream=handle))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=0x5000 + index))
    first = forward.stream_pair(0, 0x5000, kernels)
    assert forward.stream_pair(0, 0x5000, kernels)[1] is first[1] and first[1].cuda_stream == 0x9000
    assert forward.stream_pair(0, 0x7000, kernels)[1].cuda_stream == 0x9001
    assert created == [(driver.CUstream_flags.CU_STREAM_NON_BLOCKING, -5)] * 2
    assert forward.stream_pair(0, 0x8000, kernels) is None and len(created) == 2
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "3")
    monkeypatch.setattr(forward, "_current_raw_stream", lambda index: 0x8000)
    case = make_case(B=1, T=100, H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=44)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    with kda.record_dispatch() as events:
        forward.chunk_forward(p)
    assert events == ["cuda:prepare", "cuda:recurrence", "cuda:recurrence:wgmma1"], events
    names = {int(handle): name for name, handle in kernels.kernels.items()}
    assert [names[args[0]] for args, _ in libcuda.calls] == [abi.PREPARE_WGMMA_KERNEL, abi.wgmma_kernel_name(1)]


def test_time_blocks_only_where_the_rule_or_the_switch_says(monkeypatch):
    """forward.pipeline_blocks: one sequence (B = 1, cu_seqlens None or checked as [0, T]) of at
    least PIPELINE_MIN_TOKENS whose recurrence takes at most one CTA an SM, outside capture and
    training; KDA_CUDA_BLOCKS
    forces a count wherever the call qualifies, 1 turns it off, anything else is refused."""
    from types import SimpleNamespace as P

    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", None)
    monkeypatch.setattr(kda.cuda, "WARPS_OVERRIDE", None)
    blocks = forward.pipeline_blocks

    def seq(B=1, N=1, H=32, T=32768, cu=None, values=None):
        return P(B=B, N=N, H=H, T=T, cu_seqlens=cu, cu_seqlens_values=values)

    long, cu = seq(), torch.tensor([0, 32768])
    assert blocks(long, 132, False, False) == forward.PIPELINE_BLOCKS
    assert blocks(seq(cu=cu, values=(0, 32768)), 132, False, False) == forward.PIPELINE_BLOCKS
    assert blocks(seq(T=forward.PIPELINE_MIN_TOKENS - 1), 132, False, False) == 1
    # K2's grid at most one CTA an SM: 4 a (sequence, head) pair at the two-warp split-K width
    assert blocks(seq(H=33), 132, False, False) == forward.PIPELINE_BLOCKS
    assert blocks(seq(H=34), 132, False, False) == 1 and blocks(seq(H=67), 132, False, False) == 1
    assert blocks(seq(B=2, N=2), 132, False, False) == 1
    assert blocks(seq(cu=cu), 132, False, False) == 1  # lengths never checked on the host
    assert blocks(seq(N=2, cu=torch.tensor([0, 16384, 32768]), values=(0, 16384, 32768)), 132, False, False) == 1
    assert blocks(long, 132, True, False) == 1 and blocks(long, 132, False, True) == 1
    for override, T, want in (("1", 32768, 1), ("5", 100, 5), ("50", 100, 7), ("3", 16, 1), ("3", 0, 1)):
        monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", override)
        assert blocks(seq(H=96, T=T), 132, False, False) == want, override
    monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", "3")
    assert blocks(seq(B=2, N=2, H=2, T=100), 132, False, False) == 1
    for bad in ("0", "-1", "x", ""):
        monkeypatch.setattr(kda.cuda, "BLOCKS_OVERRIDE", bad)
        with pytest.raises(ValueError, match="KDA_CUDA_BLOCKS"):
            blocks(long, 132, False, False)
    for T, count in ((100, 3), (100, 50), (4096, 8), (4097, 8), (16, 4), (33, 2)):
        bounds = forward.block_bounds(T, count)
        assert len(bounds) <= count and bounds[0][0] == 0 and bounds[-1][1] == T
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(t0 % abi.CHUNK == 0 for t0, _ in bounds)
        assert all(t1 > t0 for t0, t1 in bounds)
    assert forward.block_bounds(100, 3) == [(0, 48), (48, 96), (96, 100)]


def test_shared_runs_refuse_calls_that_differ_in_what_k1_reads():
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    q, k, v, g, beta = case.tensors()
    kw = case.kwargs()
    first = checked_problem(kda.chunk_kda, q, k, v, g, beta, **kw)
    for name, other in (("q", q.clone()), ("scale", 0.5)):
        args = dict(q=q, k=k, v=v, g=g, beta=beta) | ({name: other} if name == "q" else {})
        over = kw | ({"scale": other} if name == "scale" else {})
        with pytest.raises(ValueError, match="may differ in v and initial_state only"):
            forward.chunk_forward_runs([first, checked_problem(kda.chunk_kda, **args, **over)])


class CudaTensorStandIn:
    """What build_tables asks of ``q``, answered as by a tensor on GPU 0 while its tables are
    allocated on the CPU: the CUDA builder's launch is then requested (from the fake driver)."""

    device = torch.device("cpu")
    is_cuda, is_cpu = True, False

    def get_device(self) -> int:
        return 0


@pytest.mark.parametrize(
    "cu, B, T, order_max, flags",
    [([0, 20, 25, 25, 40000], 1, 40000, None, ("varlen", "rank_by_length")),
     ([0, 20, 25, 25, 40000], 1, 40000, 3, ("varlen",)),  # past ORDER_MAX: no ranking
     (torch.tensor([0, 3, 40000], dtype=torch.int32), 1, 40000, None, ("varlen", "rank_by_length", "cu_seqlens_int32")),
     (None, 65, 40, None, ())],
)  # fmt: skip
def test_cuda_tables_are_built_by_one_launch_of_kda_build_tables(load_kernels, monkeypatch, cu, B, T, order_max, flags):
    """Given the CUDA path's kernels and a GPU's tensors, chunk_tables launches kda_build_tables
    on the given stream: its TablesParams block field by field (the tables' own addresses, the
    shapes, the flags), one CTA for the offsets, then the slot and sequence blocks; batched
    tables are still kept per stream (no second launch)."""
    libcuda, kernels = fake_device(load_kernels, monkeypatch, block=loader.TablesParams)
    monkeypatch.setattr(tables, "_BATCHED", {})
    if order_max is not None:
        monkeypatch.setattr(tables, "ORDER_MAX", order_max)
    cu = torch.tensor(cu) if isinstance(cu, list) else cu
    N = B if cu is None else cu.numel() - 1
    p = SimpleNamespace(cu_seqlens=cu, N=N, B=B, T=T, H=3, K=128, q=CudaTensorStandIn())
    t = chunk_tables(p, False, kernels, 0x5000)
    if cu is None:  # kept for the stream: no second launch
        assert chunk_tables(p, False, kernels, 0x5000) is t

    ((args, block),) = libcuda.calls
    slots = tables.chunk_slots(B, T, N, cu is not None)
    grid = 1 + -(-slots // abi.TABLES_SLOTS) + -(-N // abi.TABLES_SEQS)
    assert grid == abi.tables_grid(slots, N) and grid > 3  # several slot or sequence blocks
    handle = int(kernels.kernels[abi.TABLES_KERNEL])
    argument_array = ctypes.addressof(kernels.tables_argument_array)
    assert args == (handle, grid, 1, 1, abi.TABLES_THREADS, 1, 1, 0, 0x5000, argument_array, None)
    assert {name: getattr(block, name) for name, _ in loader.TablesParams._fields_} == dict(
        cu_seqlens=0 if cu is None else cu.data_ptr(), seq_offsets=t.seq_offsets.data_ptr(),
        chunk_offsets=t.chunk_offsets.data_ptr(), chunk_seq=t.chunk_seq.data_ptr(), seq_order=t.seq_order.data_ptr(),
        checkpoint_offsets=t.checkpoint_offsets.data_ptr(), num_chunks=slots, num_seqs=N, tokens=T,
        tokens_each=0 if cu is not None else T, heads=3, flags=sum(loader.FLAGS[name] for name in flags),
    )  # fmt: skip
    assert t.num_chunks == slots and t.seq_order.numel() == N * 3


def test_the_cuda_path_hands_its_kernels_to_the_tables(load_kernels, monkeypatch):
    """The CUDA forward (and its runs) and the training chain give chunk_tables the loaded
    kernels and the current stream, so a GPU's tables come from kda_build_tables (above)."""
    from kda.cuda import training

    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    asked = []

    def spy(p, capturing=None, kernels=None, stream=None):
        asked.append((kernels, stream))
        return chunk_tables(p, capturing, kernels, stream)

    monkeypatch.setattr(forward, "chunk_tables", spy)
    monkeypatch.setattr(training, "chunk_tables", spy)
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    forward.chunk_forward(p)
    forward.chunk_forward_runs([p, p])
    o, ht = forward._outputs(p)
    forward.run_stages(p, o, ht, torch.empty(forward.workspace_bytes(p), dtype=torch.uint8))
    training.state_grad_chain(p, torch.zeros(p.v.shape, dtype=torch.bfloat16), None, None,
                              torch.empty(3, 2, 128, 128, dtype=torch.bfloat16))  # fmt: skip
    assert asked == [(kernels, 0x5000)] * 4


def test_a_thread_without_a_current_context_gets_the_primary_one(load_kernels, monkeypatch):
    """Launches happen in the calling thread's current context: a thread that has none (it
    only met torch's caches) makes the device's primary context current, once per thread."""
    import threading

    calls = []
    monkeypatch.setattr(driver, "cuCtxGetCurrent", lambda: (OK, driver.CUcontext(0)))
    monkeypatch.setattr(
        driver, "cuDevicePrimaryCtxRetain", lambda dev: calls.append("retain") or (OK, driver.CUcontext(0x99))
    )
    monkeypatch.setattr(driver, "cuCtxSetCurrent", lambda ctx: calls.append(int(ctx)) or (OK,))
    libcuda = FakeLibcuda()  # alive while its C callback may be called
    kernels = load_kernels(libcuda.launch)
    kernels.bind_context(0)
    kernels.bind_context(0)
    assert calls == ["retain", 0x99]
    worker = threading.Thread(target=kernels.bind_context, args=(0,))
    worker.start()
    worker.join()
    assert calls == ["retain", 0x99, "retain", 0x99]


def test_grids_past_cuda_limits_are_refused_before_the_driver(load_kernels):
    libcuda = FakeLibcuda()  # alive while its C callback may be called
    kernels = load_kernels(libcuda.launch)
    name = next(iter(kernels.kernels))
    for grid in ((2**32 + 5, 1), (0, 1), (1, 2**16)):
        with pytest.raises(ValueError, match="outside CUDA's limits"):
            kernels.launch(name, grid, 32, 0, 0)


def test_small_workspaces_are_kept_per_stream_and_large_ones_allocated_per_call(load_kernels, monkeypatch):
    libcuda = FakeLibcuda()  # alive while its C callback may be called
    kernels = load_kernels(libcuda.launch)
    monkeypatch.setattr(loader, "kernels", lambda: kernels)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "_current_device", None)
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    stream = {"handle": 0x5000}
    monkeypatch.setattr(forward, "_current_raw_stream", lambda index: stream["handle"])
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())

    def workspace_of_next_call(problem):
        libcuda.calls.clear()
        forward.chunk_forward(problem)
        (_, prm), _ = libcuda.calls
        return prm.workspace

    # Keyed by q's device: -1 for these CPU tensors, never the key of a GPU.
    first = workspace_of_next_call(p)
    assert workspace_of_next_call(p) == first == forward._workspaces[-1, 0x5000].data_ptr()
    stream["handle"] = 0x6000
    assert workspace_of_next_call(p) != first and set(forward._workspaces) == {(-1, 0x5000), (-1, 0x6000)}
    bigger = make_case(seq_lens=[90, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=5)
    pb = checked_problem(kda.chunk_kda, *bigger.tensors(), **bigger.kwargs())
    workspace_of_next_call(pb)
    assert forward._workspaces[-1, 0x6000].numel() == forward.workspace_bytes(pb), "outgrown: replaced"
    assert workspace_of_next_call(p) == forward._workspaces[-1, 0x6000].data_ptr(), "a bigger one serves too"
    monkeypatch.setattr(forward, "SHARED_WORKSPACE_BYTES", forward.workspace_bytes(p) - 1)
    stream["handle"] = 0x7000
    workspace_of_next_call(p)
    assert (-1, 0x7000) not in forward._workspaces, "a workspace over the limit must not be kept"
    forward.release_workspaces()
    assert not forward._workspaces


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_cuda_decode_fills_its_params_block_field_by_field(load_kernels, monkeypatch, mode):
    """The DecodeParams block, packed positionally, field by field under its own name: a plain
    call (mode 0), 1-D slot indices (int32) and 2-D ones (int64) with accepted counts."""
    from kda.cuda import decode as cuda_decode
    from kda.validation import check_pool

    libcuda, kernels = fake_device(load_kernels, monkeypatch, loader.DecodeParams)
    lens = [2, 1, 3] if mode == 2 else None
    case = make_case(seq_lens=lens, B=3, T=1, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound",
                     seed=6)  # fmt: skip
    kw = case.kwargs(state_v_first=mode == 1)
    kw.pop("safe_gate")
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    idx = accepted = None
    if mode:
        pool = torch.zeros(5, 4, 128, 128)
        idx = torch.tensor([4, -1, 0], dtype=torch.int32) if mode == 1 else torch.tensor([[0, 1, 2]] * 3)
        accepted = torch.tensor([1, 2, 3]) if mode == 2 else None
        p = check_pool(p, pool, idx, accepted)
    o, ht = cuda_decode.decode(p)
    ((args, prm),) = libcuda.calls
    h0 = p.pool if mode else p.initial_state
    pointers = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, A_log=p.A_log, dt_bias=p.dt_bias, h0=h0)
    pointers |= dict(ht=p.pool if mode else ht, o=o, seq_offsets=p.cu_seqlens, indices=idx, accepted=accepted)
    assert {name: getattr(prm, name) for name in pointers} == {
        name: 0 if x is None else x.data_ptr() for name, x in pointers.items()
    }
    flags = loader.FLAGS
    expected_flags = flags["gate_lower_bound"] | flags["has_A_log"] | flags["has_dt_bias"] | flags["l2norm"]
    expected_flags |= flags["beta_sigmoid"] | flags["has_h0"] | flags["store_ht"]
    expected_flags |= flags["g_float32"] | flags["beta_float32"]
    expected_flags |= flags["varlen"] | flags["indices_int64"] | flags["accepted_int64"] if mode == 2 else 0
    assert prm.flags == expected_flags
    T = 6 if mode == 2 else 1
    assert (prm.tokens, prm.num_seqs, prm.pool_slots, prm.heads, prm.value_heads) == (T, 3, 5 if mode else 3, 2, 4)
    assert (prm.index_cols, prm.index_mode) == (3 if mode == 2 else 1, mode)
    assert (prm.scale, prm.lower_bound, prm.beta_scale) == (p.scale, -5.0, 1.0)
    columns = 64  # float32 states (cuda_decode.DEFAULT_COLUMNS)
    name = loader.DECODE_KERNELS[("float32", "float32", mode == 1, columns)]
    assert args[0] == int(kernels.kernels[name])
    assert args[1:9] == ((128 // columns) * 3 * 4, 1, 1, 128, 1, 1, 0, 0x5000)


@pytest.mark.parametrize(
    "state, final, pool, want",
    [
        (torch.bfloat16, torch.float32, False, "kda_decode_bf16_to_f32_kv_c128"),
        (torch.bfloat16, torch.bfloat16, False, "kda_decode_bf16_kv_c128"),
        (torch.bfloat16, None, True, "kda_decode_bf16_kv_c128"),
        (torch.float32, torch.float32, False, "kda_decode_f32_kv_c64"),
    ],
)
def test_cuda_decode_picks_the_entry_point_of_its_state_dtypes(load_kernels, monkeypatch, state, final, pool, want):
    """A bf16 state written back in float32 (a plain call's default final state) launches a
    _to_f32 entry point; a bf16 final state, or a bf16 pool (one dtype, in place), the bf16 one
    (2026-12-07)."""
    from kda.cuda import decode as cuda_decode
    from kda.validation import check_pool

    libcuda, kernels = fake_device(load_kernels, monkeypatch, loader.DecodeParams)
    case = make_case(B=3, T=1, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=8)
    case.initial_state = case.initial_state.to(state)
    kw = case.kwargs(final_state_dtype=final)
    kw.pop("safe_gate")
    if pool:
        kw.pop("initial_state"), kw.pop("output_final_state")
        p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
        p = check_pool(p, torch.zeros(5, 4, 128, 128, dtype=state), torch.tensor([4, -1, 0]), None)
    else:
        p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    assert cuda_decode.decode_rejects(p) is None, cuda_decode.decode_rejects(p)
    o, ht = cuda_decode.decode(p)
    ((args, prm),) = libcuda.calls
    assert args[0] == int(kernels.kernels[want]), [n for n, k in kernels.kernels.items() if int(k) == args[0]]
    assert ht.dtype == (state if pool else final)


@pytest.mark.parametrize("offset, refused", [(8, True), (4, True), (16, False)])
def test_decode_refuses_a_state_off_its_16_byte_copies(offset, refused):
    """An initial state that is a view 4 or 8 bytes into its storage cannot feed the decode
    kernel's 16-byte copies: kda.cuda.decode.decode_rejects says so (and Triton runs it); 16
    bytes in, it can (a mutation audit of 2026-12-05 found a check of 8 bytes passing)."""
    from kda.cuda.decode import decode_rejects

    case = make_case(B=4, T=1, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=7)
    h0 = case.initial_state
    case.initial_state = torch.empty(h0.numel() + 4, dtype=torch.float32)[offset // 4 :][: h0.numel()].view(h0.shape)
    case.initial_state.copy_(h0)
    kw = case.kwargs()
    kw.pop("safe_gate")
    p = checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)
    assert p.initial_state.data_ptr() % 16 == offset % 16, "validation kept the view"
    reason = decode_rejects(p)
    assert (reason == "a state that is not 16-byte aligned (a view at an odd offset)") if refused else reason is None


def test_auto_sends_decode_shapes_to_the_cuda_kernel_where_it_measured_faster():
    """kda.cuda.decode.AUTO_MIN_PAIRS on host-side problems (no device work): one-token decode
    steps over enough sequence-heads are kept (no refusal), the rest say why Triton runs them."""
    from kda.cuda import BACKEND
    from kda.cuda.decode import AUTO_MIN_PAIRS

    def problem(B, T=1, state=torch.bfloat16, v_first=False):  # no initial state: the final state's dtype decides
        case = make_case(B=B, T=T, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=7,
                         with_state=False)  # fmt: skip
        kw = case.kwargs(final_state_dtype=state, state_v_first=v_first)
        kw.pop("safe_gate")
        return checked_problem(kda.fused_recurrent_kda, *case.tensors(), **kw)

    bf16 = AUTO_MIN_PAIRS[("bfloat16", False)] // 4
    fp32 = AUTO_MIN_PAIRS[("float32", False)] // 4
    assert BACKEND.auto_rejects(problem(bf16)) is None
    assert BACKEND.auto_rejects(problem(fp32, state=torch.float32)) is None
    assert "4 (sequence, head) pairs of bfloat16 states" in BACKEND.auto_rejects(problem(1))
    assert f"{fp32 * 2} (sequence, head) pairs of float32 states" in BACKEND.auto_rejects(
        problem(fp32 // 2, state=torch.float32)
    )
    assert "bfloat16 states over more than one token" in BACKEND.auto_rejects(problem(2, T=3))
    assert "bfloat16 states over more than one token" in BACKEND.auto_rejects(problem(2, T=2))  # (the bound)
    # float32 [V, K] states keep their own bound (kda.cuda.decode.AUTO_MIN_PAIRS_V_FIRST_FLOAT32)
    v_first = problem(fp32, state=torch.float32, v_first=True)
    assert f"{fp32 * 4} (sequence, head) pairs of float32 [V, K] states" in BACKEND.auto_rejects(v_first)


@pytest.mark.parametrize("dht_dtype", [torch.float32, torch.bfloat16, None])
def test_state_grad_chain_fills_the_params_block_as_the_chain_reads_it(load_kernels, monkeypatch, dht_dtype):
    """kda.cuda.training.state_grad_chain: K1, then the chain at CHAIN_WARPS, one Params block
    whose v is dO, h0 the final state's gradient, ht the initial state's and checkpoints the
    per-chunk state gradients (recurrence.cu's state_grad_chain)."""
    from kda.cuda import training

    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    built = []
    monkeypatch.setattr(training, "chunk_tables", lambda p, *args: built.append(chunk_tables(p, *args)) or built[-1])
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(state_v_first=True))
    do = torch.randn(p.v.shape).to(torch.bfloat16)
    dht = None if dht_dtype is None else torch.randn(p.state_shape).to(dht_dtype)
    dh0 = torch.empty(p.state_shape)
    dstates = torch.empty(3, 2, 128, 128, dtype=torch.bfloat16)
    workspace = training.state_grad_chain(p, do, dht, dh0, dstates)

    (prepare_args, prm), (chain_args, prm_again) = libcuda.calls
    assert bytes(prm) == bytes(prm_again)
    (tables,) = built
    pointers = dict(q=p.q, k=p.k, v=do, g=p.g, beta=p.beta, h0=dht, ht=dh0, checkpoints=dstates, workspace=workspace)
    pointers |= dict(seq_offsets=tables.seq_offsets, checkpoint_offsets=tables.checkpoint_offsets)
    assert {name: getattr(prm, name) for name in pointers} == {
        name: 0 if x is None else x.data_ptr() for name, x in pointers.items()
    }
    assert prm.o == 0
    flags = loader.FLAGS
    state_bits = flags["store_ht"] | flags["state_v_first"]
    state_bits |= 0 if dht is None else flags["has_h0"] | (flags["h0_bfloat16"] if dht_dtype == torch.bfloat16 else 0)
    assert prm.flags == forward.input_flags(p) | state_bits
    name, shared_bytes = loader.CHAIN_KERNELS[training.CHAIN_WARPS]
    assert prepare_args[0] == int(kernels.kernels["kda_prepare"]) and prepare_args[1:3] == (tables.num_chunks, 2)
    assert chain_args[0] == int(kernels.kernels[name])
    assert chain_args[1:9] == (128 // (16 * training.CHAIN_WARPS) * 2 * 2, 1, 1, 32 * (training.CHAIN_WARPS + 1), 1, 1,
                               shared_bytes, 0x5000)  # fmt: skip


def test_state_grad_chain_refuses_wrong_buffers():
    from kda.cuda import training

    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    do = torch.randn(p.v.shape).to(torch.bfloat16)
    dstates = torch.empty(3, 2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do must be bfloat16"):
        training.state_grad_chain(p, do.float(), None, None, dstates)
    with pytest.raises(ValueError, match="dht must be float32 or bfloat16"):
        training.state_grad_chain(p, do, torch.empty(p.state_shape, dtype=torch.float16), None, dstates)
    with pytest.raises(ValueError, match="dh0 must be float32"):
        training.state_grad_chain(p, do, None, torch.empty(p.state_shape, dtype=torch.bfloat16), dstates)


def products_inputs(p, tables):
    """What kda.cuda.training.state_products takes for ``p`` (CPU tensors of the right shapes)."""
    from kda.cuda import training
    from kda.triton.training import checkpoint_shape

    NC, H = tables.num_chunks, p.H
    return dict(
        do=torch.randn(p.v.shape).to(torch.bfloat16),
        checkpoints=torch.randn(checkpoint_shape(p)),
        dstates=torch.randn(NC, H, 128, 128).to(torch.bfloat16),
        workspace=torch.empty(forward.workspace_bytes(p, tables), dtype=torch.uint8),
        tables=tables,
        scratch=torch.empty(training.product_scratch_numel(NC, H)),
        dv=torch.empty_like(p.v),
    )


def test_state_products_fill_the_params_block_as_the_kernel_reads_it(load_kernels, monkeypatch):
    """kda.cuda.training.state_products: one launch of kda_state_products, a CTA an SM (here 3)
    or one per (checkpoint row, head) item where there are fewer, with q = dO, h0 = dS, ht =
    the scratch, o = dV (recurrence.cu's state_products)."""
    from kda.cuda import training

    libcuda, kernels = fake_device(load_kernels, monkeypatch)
    case = make_case(seq_lens=[70, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=5)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    tables = chunk_tables(p)
    args = products_inputs(p, tables)
    for sms, ctas in ((3, 3), (64, args["checkpoints"].shape[0] * 2)):
        monkeypatch.setattr(training, "sm_count", lambda index, sms=sms: sms)
        libcuda.calls.clear()
        with kda.record_dispatch() as events:
            training.state_products(p, **args)
        assert events == ["cuda:state_products"], events
        ((launch, prm),) = libcuda.calls
        pointers = dict(q=args["do"], v=p.v, h0=args["dstates"], ht=args["scratch"], o=args["dv"],
                        workspace=args["workspace"], checkpoints=args["checkpoints"],
                        checkpoint_offsets=tables.checkpoint_offsets, seq_offsets=tables.seq_offsets)  # fmt: skip
        assert {name: getattr(prm, name) for name in pointers} == {n: x.data_ptr() for n, x in pointers.items()}
        assert (prm.num_chunks, prm.num_seqs, prm.heads) == (tables.num_chunks, 2, 2)
        name, shared_bytes = loader.PRODUCTS_KERNEL
        assert launch[0] == int(kernels.kernels[name])
        assert launch[1:9] == (ctas, 1, 1, loader.PRODUCT_THREADS, 1, 1, shared_bytes, 0x5000), launch


def test_state_products_refuse_wrong_buffers():
    from kda.cuda import training

    case = make_case(seq_lens=[70, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=5)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
    tables = chunk_tables(p)
    good = products_inputs(p, tables)
    wrong = {
        "do": (good["do"].float(), "do must be torch.bfloat16"),
        "dv": (torch.empty(*p.v.shape[:-1], 256, dtype=torch.bfloat16)[..., :128], "dv must be contiguous"),
        "dstates": (good["dstates"][:-1], "dstates must be torch.bfloat16 of shape"),
        "checkpoints": (good["checkpoints"][:1], "checkpoints must be torch.float32 of shape"),
        "scratch": (good["scratch"][1:], "scratch must be torch.float32 of shape"),
        "workspace": (good["workspace"][:-16], "workspace must hold"),
    }
    for name, (bad, message) in wrong.items():
        with pytest.raises(ValueError, match=message):
            training.state_products(p, **(good | {name: bad}))
    misaligned = torch.empty(good["do"].numel() + 1, dtype=torch.bfloat16)[1:].view(good["do"].shape)
    with pytest.raises(ValueError, match="do must be contiguous and 16-byte aligned"):
        training.state_products(p, **(good | {"do": misaligned}))


def test_shared_runs_that_take_another_route_run_alone_with_their_zeros(monkeypatch):
    """CudaBackend.run_shared declines calls that would not run K1 and K2 (here: with grad), and
    kda.api.chunk_kda_runs then runs them one by one through run, a run whose v is zeros with a
    zero v made (its problem's v is a template)."""
    from kda.api import chunk_kda_runs
    from kda.cuda import BACKEND

    monkeypatch.setattr(dispatch, "select", lambda problem, requested: BACKEND)
    seen = []
    monkeypatch.setattr(type(BACKEND), "run", lambda self, p: seen.append(p) or (p.v, None))
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    q, k, v, g, beta = case.tensors()
    q.requires_grad_()
    kw = case.kwargs()
    h0 = kw.pop("initial_state")
    kw.pop("output_final_state")
    problems = [checked_problem(kda.chunk_kda, q, k, v, g, beta, initial_state=h0, **kw) for _ in range(2)]
    assert all(p.requires_grad for p in problems) and BACKEND.run_shared(problems, [False, True]) is None
    results = list(chunk_kda_runs(q, k, g, beta, [(v, h0), (None, h0)], kw))
    assert [o for o, _ in results] == [p.v for p in seen] and seen[0].v is v
    assert seen[1].v is not v and seen[1].v.shape == v.shape and not seen[1].v.any() and v.any()


def test_transition_runs_share_their_checked_inputs_on_the_cuda_path(monkeypatch):
    """kda.api.chunk_kda_runs on the CUDA path with inputs that validation copies or converts (a
    non-contiguous q, bf16 A_log and dt_bias): every run gets the first run's checked tensors, so
    one K1 serves them all (forward.share_prepare) instead of a refusal; a zero v's problem carries
    the first's checked v. (Until 2026-12-03 each run was checked on its own, got its own copies,
    and chunk_forward_runs refused the split.)"""
    from kda.api import chunk_kda_runs
    from kda.cuda import BACKEND

    monkeypatch.setattr(dispatch, "select", lambda problem, requested: BACKEND)
    handed = []
    monkeypatch.setattr(forward, "chunk_forward_runs", lambda problems, v_zero: handed.append((problems, v_zero)) or [])
    case = make_case(seq_lens=[20, 5], H=2, K=128, V=128, dtype=torch.bfloat16, gate="lower_bound", seed=4)
    q, k, v, g, beta = case.tensors()
    wide = torch.cat([q, q], dim=-1)[..., :128]  # a slice of a fused projection: not contiguous
    assert not wide.is_contiguous()
    kw = case.kwargs(A_log=case.A_log.to(torch.bfloat16), dt_bias=case.dt_bias.to(torch.bfloat16))
    kw.pop("initial_state"), kw.pop("output_final_state")
    zeros = torch.zeros(case.initial_state.shape)
    chunk_kda_runs(wide, k, g, beta, [(v, zeros), (None, torch.randn(zeros.shape))], kw)
    ((problems, v_zero),) = handed
    assert v_zero == [False, True] and forward.share_prepare(problems)
    first, second = problems
    assert second.q is first.q and second.A_log is first.A_log and second.dt_bias is first.dt_bias
    assert second.v is first.v and first.A_log.dtype == torch.float32
