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
# On the GPU each example compiles what it has not met (Triton, without autotuning): 20 examples
# keep a run of the whole suite within a few minutes of a lent machine.
settings.register_profile("gpu", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere, with the reason)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
