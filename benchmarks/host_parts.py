"""Host time of a tiny eager ``chunk_kda`` call on a GPU, piece by piece (device runs).

python benchmarks/host_parts.py           # the pieces, then the whole call with each piece taken out
python benchmarks/host_parts.py --whole   # only the whole call (A/B runs of two installs)

Each line is the best of 15 means over 100 calls (a sync before each mean, not timed, so the
launch queue never fills). The pieces are the stages of the call (validation, dispatch, the
CUDA forward) and the primitives they are made of (allocations, torch's device and stream
queries, the driver launch), so the per-call total can be read against its parts and each
candidate cut weighed on the GPU host itself, where allocations and launches cost more than
their parts timed alone suggest.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import inspect
import os
import sys
import time
from unittest import mock

import torch

import kda
from kda import bench, dispatch, validation
from kda.cuda import forward, loader
from kda.tables import chunk_tables

CASE = {"seq_lens": [64], "H": 1}


def per_call_us(fn, calls: int = 100, repeats: int = 15) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    tensors, kw = bench.make_inputs(CASE)
    if "--whole" in sys.argv:
        return whole_call(tensors, kw)
    bound = inspect.signature(kda.chunk_kda).bind(*tensors, **kw)
    bound.apply_defaults()
    args = dict(bound.arguments)
    extra = args.pop("kwargs")
    args.pop("backend")
    p = validation.check_chunk_kda(args, extra)
    kda.chunk_kda(*tensors, backend="cuda", **kw)
    torch.cuda.synchronize()
    kernels = loader.kernels()
    o, ht = forward.chunk_forward(p)
    workspace = p.q.new_empty(forward.workspace_bytes(p), dtype=torch.uint8)
    v, h0, q = p.v, p.initial_state, p.q
    n = workspace.numel()
    stream = forward.current_stream(0)
    tables = chunk_tables(p)
    kernel = kernels.kernels["kda_prepare"]
    function = loader.check(kernels.driver.cuKernelGetFunction(kernel), "cuKernelGetFunction")
    launch = kernels.direct_launch
    argptr = kernels.arguments_pointer
    by_kernel = ctypes.c_void_p(int(kernel))
    by_function = ctypes.c_void_p(int(function))
    grid = (tables.num_chunks, p.H)
    libc_abs = ctypes.CDLL(ctypes.util.find_library("c")).abs
    uint8_template = torch.empty(0, dtype=torch.uint8, device="cuda")
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()

    def noop():
        pass

    pieces = {
        "chunk_kda cuda (whole call)": lambda: kda.chunk_kda(*tensors, backend="cuda", **kw),
        "chunk_kda auto (whole call)": lambda: kda.chunk_kda(*tensors, **kw),
        "validation.check_chunk_kda": lambda: validation.check_chunk_kda(args, extra),
        "dispatch.select cuda": lambda: dispatch.select(p, "cuda"),
        "dispatch.select auto": lambda: dispatch.select(p, "auto"),
        "forward.chunk_forward": lambda: forward.chunk_forward(p),
        "forward, outputs given": lambda: forward.run_stages(p, o, ht, workspace),
        "empty_like(v)": lambda: torch.empty_like(v),
        "empty_like(h0)": lambda: torch.empty_like(h0),
        "q.new_empty(n, dtype=uint8)": lambda: q.new_empty(n, dtype=torch.uint8),
        "uint8_template.new_empty(n)": lambda: uint8_template.new_empty(n),
        "torch.empty(n, uint8, device)": lambda: torch.empty(n, dtype=torch.uint8, device=q.device),
        "chunk_tables(p), CUDA builder": lambda: chunk_tables(p, False, kernels, stream),
        "chunk_tables(p), Triton builder": lambda: chunk_tables(p),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.cuda.current_device": torch.cuda.current_device,
        "current_stream (raw)": lambda: forward.current_stream(0),
        "kernels.configure": lambda: kernels.configure(0),
        "kernels.launch K1 (CUkernel)": lambda: kernels.launch("kda_prepare", grid, loader.PREPARE_THREADS, 0, stream),
        "direct launch K1, CUkernel": lambda: launch(
            by_kernel, grid[0], grid[1], 1, 128, 1, 1, 0, ctypes.c_void_p(stream), argptr, None
        ),
        "direct launch K1, CUfunction": lambda: launch(
            by_function, grid[0], grid[1], 1, 128, 1, 1, 0, ctypes.c_void_p(stream), argptr, None
        ),
        "direct launch K1, a side stream": lambda: launch(
            by_kernel, grid[0], grid[1], 1, 128, 1, 1, 0, ctypes.c_void_p(side.cuda_stream), argptr, None
        ),
        "ctypes libc abs, 11 args": lambda: libc_abs(
            by_kernel, grid[0], grid[1], 1, 128, 1, 1, 0, ctypes.c_void_p(stream), argptr, None
        ),
        "torch x.add_(1) (a torch launch)": lambda: x.add_(1),
        "os.environ.get unset": lambda: os.environ.get("KDA_UNSET_SWITCH"),
        "q.data_ptr()": q.data_ptr,
        "Python no-op call": noop,
    }
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, launch through "
        f"{'ctypes' if launch else 'cuda-bindings'}"
    )
    for name, fn in pieces.items():
        if fn is None or (name.startswith(("direct", "ctypes")) and launch is None):
            continue
        fn()
        print(f"{name:36s} {per_call_us(fn):7.2f} us", flush=True)
    in_context(tensors, kw, p, (o, ht, workspace), kernels)


def in_context(tensors, kw, p, outputs, kernels, rounds: int = 8) -> None:
    """The whole call with one piece taken out at a time: what each piece costs in the
    company of the others (caches and branch predictors shared with the driver and torch).
    The variants take turns, round after round, so a drift of the host's speed during the
    run reaches all of them alike; each round is a mean over 200 calls."""

    def whole():
        kda.chunk_kda(*tensors, backend="cuda", **kw)

    quiet_launch = ctypes.CDLL(ctypes.util.find_library("c")).abs
    quiet_launch.restype = None  # returns None: read as success
    given = functools.partial(forward.run_stages, o=outputs[0], ht=outputs[1], workspace=outputs[2])
    side = torch.cuda.Stream()
    variants = {
        "whole call": [],
        "launches stubbed (ctypes kept)": [mock.patch.object(kernels, "direct_launch", quiet_launch)],
        "validation skipped": [mock.patch.object(validation, "check_problem", lambda *args: p)],
        "outputs and workspace given": [mock.patch.object(kda.cuda, "_chunk_forward", lambda: given)],
        "on a side stream": [torch.cuda.stream(side)],
    }
    figures = {name: [] for name in variants}
    for _ in range(rounds):
        for name, patches in variants.items():
            with contextlib.ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                whole()
                figures[name].append(per_call_us(whole, calls=200, repeats=1))
    for name, values in figures.items():
        values.sort()
        print(f"in context: {name:32s} median {values[len(values) // 2]:6.2f} us, min {values[0]:6.2f}", flush=True)


def whole_call(tensors, kw) -> None:
    """The figure of record: the whole eager call, as the bench takes it (means over 300
    calls, five of them here) and as a best of 15 means over 100."""

    def whole():
        kda.chunk_kda(*tensors, backend="cuda", **kw)

    whole()
    probe_before = python_probe_us()
    means = sorted(per_call_us(whole, calls=300, repeats=1) for _ in range(5))
    best = per_call_us(whole)
    probe = (probe_before + python_probe_us()) / 2
    spread = f"{means[0]:.1f} {means[2]:.1f} {means[-1]:.1f}"
    print(
        f"whole call ({kda.__file__}): means of 300 (min, median, max) {spread}, best {best:.1f} us; "
        f"host speed probe {probe:.0f} us"
    )


def python_probe_us() -> float:
    """A fixed pure-Python workload (no torch, no driver), best of 5: how fast the host runs
    right now, to read a drift of the whole call's time against."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(20000):
            total += i & 7
        best = min(best, time.perf_counter() - start)
    return best * 1e6


if __name__ == "__main__":
    main()
