"""Fill Triton's on-disk autotune cache for `kda bench --train` cases, one process a case, in parallel.

    TRITON_CACHE_AUTOTUNING=1 python benchmarks/tune_cache.py 1 2      # TRAIN_CASES[1] and [2]
    TRITON_CACHE_AUTOTUNING=1 python benchmarks/tune_cache.py a0 l3    # fla's forward: ANCHOR_CASES[0], LONG_CASES[3]

fla 0.6.0 retunes its backward for every new head count (H is a constexpr in its autotune keys) and
a cold tuning took 270-310 s on the H200 (2026-12-02/03, runs 45-47), almost all of it compiling
configs on one CPU core. One process a case compiles in parallel; the timing is not shared: each
config is compiled and run once outside a file lock, then timed under it, so only one process
times at a time (a stray single launch from another process can land in a timing window; the
tuner keeps the median of its repeats). `kda bench --train` then reads the tuned configs from
the cache and times every case in one process, as the issue asks. Nothing is timed here.
"""

import fcntl
import os
import subprocess
import sys
import time

LOCK = "/tmp/kda-tune.lock"


def serialise_timing() -> None:
    """Every triton.autotune in this process: compile and one launch outside the lock, time in it."""
    import torch
    from triton.runtime import autotuner, driver

    def locked(bench):
        def run(kernel_call, quantiles):
            kernel_call()  # compiles this config (the CPU's part) and launches it once
            torch.cuda.synchronize()
            with open(LOCK, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    return bench(kernel_call, quantiles=quantiles)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

        return run

    def default():  # what triton.autotune times with when it is given no do_bench
        get = getattr(driver.active, "get_benchmarker", None)
        if get is not None:
            return get()
        import triton.testing

        return triton.testing.do_bench

    autotuner.Autotuner.do_bench = property(lambda self: locked(getattr(self, "_do_bench", None) or default()))


def tune_forward(which: str) -> None:
    """fla's forward on ``kda bench`` anchor case ``aN`` or ``kda bench --long`` case ``lN``: one
    call, which tunes it for that case's head count (85 s a new one on the H200, run 80)."""
    import torch

    from kda.bench import ANCHOR_CASES, contenders, make_inputs
    from kda.bench_long import LONG_CASES

    serialise_timing()
    case = (ANCHOR_CASES if which[0] == "a" else LONG_CASES)[int(which[1:])]
    tensors, kw = make_inputs(case)
    start = time.perf_counter()
    with torch.inference_mode():
        contenders()["fla"](tensors, kw)
    torch.cuda.synchronize()
    print(f"{case['name']}: fla first forward {time.perf_counter() - start:.1f} s", flush=True)


def tune_case(index: str) -> None:
    if index[0] in "al":
        return tune_forward(index)
    import torch

    import kda
    from kda.bench import TRAIN_CASES, fwd_bwd, make_inputs, train_contenders, train_inputs

    serialise_timing()
    case = TRAIN_CASES[int(index)]
    tensors, kw = make_inputs(case)
    for name, call in train_contenders().items():
        leaves, kw_i, _, grads_out = train_inputs(tensors, kw)
        start = time.perf_counter()
        try:
            fwd_bwd(call, leaves, kw_i, grads_out)
        except kda.BackendUnavailableError as refused:  # kda-cuda on the softplus gate (run 48 stopped there)
            print(f"{case['name']}: {name} not run: {refused}", flush=True)
            continue
        torch.cuda.synchronize()
        print(f"{case['name']}: {name} first fwd+bwd {time.perf_counter() - start:.1f} s", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--case"]:
        tune_case(argv[1])
        return 0
    if os.environ.get("TRITON_CACHE_AUTOTUNING") != "1":
        print("set TRITON_CACHE_AUTOTUNING=1 (and TRITON_CACHE_DIR): the tuned configs must reach the disk")
        return 1
    children = [subprocess.Popen([sys.executable, __file__, "--case", i]) for i in argv]
    codes = [child.wait() for child in children]  # (a child killed by a signal returns a negative code)
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
