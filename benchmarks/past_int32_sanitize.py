"""The CUDA cases of tests/test_past_int32.py that compute-sanitizer can afford, for its memcheck:
a wrap that a kernel's writer and reader of an internal tensor compute alike (K1's workspace, the
per-chunk state gradients) passes the tests' comparisons, but a signed 32-bit index that wraps goes
negative, before its allocation, which memcheck reports.

    SANITIZER_TOOLS=memcheck SANITIZE_SCRIPT=benchmarks/past_int32_sanitize.py SANITIZER_TIMEOUT=400 \\
        bash benchmarks/gpu_session.sh sanitize

torch's caching allocator is off, so each tensor is its own allocation and an access past one is not
inside another's pooled block."""

import os
import sys

os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # (before torch is imported, by pytest's collection)

import pytest  # noqa: E402

# the pool's decode step and prefill, and the training step (the forward's 2^21-token calls would
# take memcheck's slowdown times 30 ms of kernels on 2^31 elements, and their memory, without the cache)
CASES = "cuda and (pool or (gradients and state))"
# (PAST_INT32_CASES: another -k selection, as a call with less time left runs one case)
sys.exit(
    pytest.main(
        ["-q", "-p", "no:cacheprovider", "tests/test_past_int32.py", "-k", os.environ.get("PAST_INT32_CASES", CASES)]
    )
)
