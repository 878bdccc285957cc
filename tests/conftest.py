"""Test setup: the Triton interpreter on CPU-only machines, hypothesis profiles, markers."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before any kda.triton import: triton.jit reads it when kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
# On the GPU each example compiles what it has not met (Triton, without autotuning): 12 examples
# keep a run of the whole suite within a few minutes of a lent machine (20 took the fp32 gradient
# test to 290 s of its 300, 2026-12-01).
# Not derandomized: each GPU run tries new examples. A failure prints its arguments (and a blob
# for @reproduce_failure); pin it with @example, as test_backward does.
settings.register_profile(
    "gpu", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"))

# Under pytest-xdist each worker would start torch with one CPU thread per core: 14 workers on the
# H200 machine's 16 cores ran 224 threads, and the CPU-bound tests (float64 gradcheck, the torch
# reference, Triton's compiler) took up to 290 s each (2026-12-01, run at 749c1b5). Share the cores.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere, with the reason)")
    config.addinivalue_line(
        "markers", "bigmem: tensors past 2^31 elements, 20 to 60 GB of GPU memory (one at a time, by a file lock)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# (here, not in test_cuda.py: test_cuda_launch.py sets switches too)
@pytest.fixture
def switches(monkeypatch):
    """Set or clear the backend's environment switches and re-read them (they are read at
    import); the switches of the environment are read back afterwards."""
    import kda.cuda

    def switch(name, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        kda.cuda.read_switches()

    yield switch
    monkeypatch.undo()
    kda.cuda.read_switches()
