"""Host time of a tiny eager ``chunk_kda(backend="cuda")`` call, measured without a GPU.

python benchmarks/host_overhead_cpu.py [--profile]

The issue's budget is 40 us of host time per eager call on the tiny case (T = 64, H = 1,
varlen with cu_seqlens_cpu, initial and final state, lower-bound gate);
``benchmarks/cuda_profile.py host`` times the real thing on a GPU. Here the same Python runs
on CPU tensors with the device stubbed: the backend is made available and accepts CPU
tensors, the kernels "load" from empty files through a stubbed cuda-bindings, torch's
current device and stream are constants, and the direct launch calls libc's ``abs`` in place
of libcuda's ``cuLaunchKernel``, with the same eleven arguments, so ctypes' argument passing
is timed as on a GPU.

Not timed here: the CUDA caching allocator (CPU allocations stand in), torch's device and
stream queries, the driver's own launch work, and the chunk tables. On a GPU those are one
launch of the CUDA path's builder (``kda.tables``); CPU tensors would get them from torch ops
instead, which cost about 200 us and run nowhere else, so the tables of the first call stand
in for every call's.
"""

import contextlib
import cProfile
import ctypes
import ctypes.util
import inspect
import pstats
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from cuda.bindings import driver

import kda
import kda.cuda
from kda import bench, dispatch, validation
from kda.cuda import forward, loader
from kda.tables import chunk_tables

CASE = {"seq_lens": [64], "H": 1}
OK = driver.CUresult.CUDA_SUCCESS
DRIVER_STUBS = {
    "cuInit": lambda flags: (OK,),
    "cuLibraryLoadData": lambda *args: (OK, driver.CUlibrary(0)),
    "cuLibraryGetKernel": lambda library, name: (OK, driver.CUkernel(0)),
    "cuDeviceGet": lambda index: (OK, driver.CUdevice(index)),
    "cuKernelSetAttribute": lambda *args: (OK,),
    "cuLaunchKernel": lambda *args: (OK,),
    "cuCtxGetCurrent": lambda: (OK, driver.CUcontext(1)),
}


def first_tables():
    """``chunk_tables`` that builds the first call's tables and returns them to every call."""
    built = []

    def tables(p, capturing=None, kernels=None, stream=None):
        if not built:
            built.append(chunk_tables(p))
        return built[0]

    return tables


def stub_launch():
    """libc's ``abs`` called like ``loader.driver_launch()``'s cuLaunchKernel: it reads only
    the first argument (the kernel handle, 0 here) and returns 0, success."""
    launch = ctypes.CDLL(ctypes.util.find_library("c")).abs
    launch.restype = ctypes.c_int
    return launch


@contextlib.contextmanager
def stubbed_device(folder: Path):
    real_rejects = kda.cuda.CudaBackend.rejects

    def rejects(self, p):
        reason = real_rejects(self, p)
        return None if reason is not None and reason.startswith("tensors on cpu") else reason

    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (kda.cuda, "TURNED_OFF", False),
            (kda.cuda, "_static_availability", lambda: None),
            (kda.cuda, "_capability", lambda index: (9, 0)),
            (kda.cuda.CudaBackend, "rejects", rejects),
            (loader, "find_kernels", lambda: (folder, None)),
            (loader, "stale", lambda folder: None),
            (loader, "driver_launch", stub_launch),
            (torch.cuda, "current_device", lambda: 0),
            (dispatch, "_current_device", None),
            (forward, "_current_raw_stream", lambda index: 0),
            (forward, "sm_count", lambda index: 132),
            (forward, "chunk_tables", first_tables()),
            *((driver, name, stub) for name, stub in DRIVER_STUBS.items()),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        loader.kernels.cache_clear()
        stack.callback(loader.kernels.cache_clear)
        yield


def per_call_us(fn, calls: int = 500, repeats: int = 60) -> float:
    """The best of ``repeats`` means over ``calls`` calls (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    tensors, kw = bench.make_inputs(CASE, device="cpu")
    bound = inspect.signature(kda.chunk_kda).bind(*tensors, **kw)
    bound.apply_defaults()
    args = dict(bound.arguments)
    extra = args.pop("kwargs")
    args.pop("backend")
    with tempfile.TemporaryDirectory() as tmp:
        for name in loader.ARTEFACTS:
            (Path(tmp) / name).write_bytes(b"")
        with stubbed_device(Path(tmp)):
            p = validation.check_chunk_kda(args, extra)
            kda.chunk_kda(*tensors, backend="cuda", **kw)  # loads the stub kernels, builds the tables
            launch = "ctypes" if loader.kernels().direct_launch else "cuda-bindings"
            print(f"torch {torch.__version__}, launch through {launch}")
            stages = {
                "validation": lambda: validation.check_chunk_kda(args, extra),
                "dispatch": lambda: dispatch.select(p, "cuda"),
                "forward": lambda: forward.chunk_forward(p),
                "chunk_kda cuda": lambda: kda.chunk_kda(*tensors, backend="cuda", **kw),
                "chunk_kda auto": lambda: kda.chunk_kda(*tensors, backend="auto", **kw),
            }
            for name, fn in stages.items():
                print(f"{name:16s} {per_call_us(fn):6.1f} us per call")
            if "--profile" in sys.argv:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(3000):
                    kda.chunk_kda(*tensors, backend="cuda", **kw)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
