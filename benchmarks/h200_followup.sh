#!/usr/bin/env bash
# The call after h200_call.sh on the same warm H200 (2026-12-06): the split's outputs' kernel at its
# launches (outsweep, 1x2097152 H8; output_launch_sweep.py has three stages with V in two parts for the
# H200 since bda4672), then the six-CTA decode build's GPU decode and pool tests (its decode A/B is
# h200_call.sh's, which runs first). Carries: .whl, .kernels, .kernels-six.
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 200 env SWEEP_CASES=3 SWEEP_TIMEOUT=190 OUT=$OUT bash benchmarks/gpu_session.sh outsweep 2>&1 | tail -16
timeout 120 env KERNELS=.kernels-six TESTS="tests/test_cuda_decode.py tests/test_pools.py" BIGMEM=0 WORKERS=14 \
  TEST_TIMEOUT=110 OUT=$OUT/six-tests bash benchmarks/gpu_session.sh tests 2>&1 | tail -6
tar czf "$OUT/six-tests.tgz" -C "$OUT" six-tests && rm -rf "$OUT/six-tests"
