#!/usr/bin/env bash
# One device call (2026-12-06, after run 171): chunk_input_grads_kernel's restore_value on a GPU.
# Run 171's memcheck step (no KDA_TRITON_AUTOTUNE=0, a cold cache for its key) tuned that kernel,
# which rewrites two of its inputs, and the training test past 2^31 got dq of order 1e-23. First
# the backward's and CUDA training's GPU tests (test_autotuning_leaves_every_result_alone among
# them, CUDA and Triton), then on an H200 the K1 candidates' A/B in one round
# (k1_candidates_call.sh); on an H100 the memcheck of the training case past 2^31 again.
# Carries: .whl, .kernels and the five K1 candidate folders.
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout ${TRAIN_TESTS_TIMEOUT:-170} env TESTS="tests/test_backward.py tests/test_cuda_training.py" BIGMEM=0 WORKERS=14 \
  TEST_TIMEOUT=$((${TRAIN_TESTS_TIMEOUT:-170} - 10)) OUT=$OUT/train-tests bash benchmarks/gpu_session.sh tests 2>&1 | tail -8
tar czf "$OUT/train-tests.tgz" -C "$OUT" train-tests && rm -rf "$OUT/train-tests"
if [[ $card == *H200* ]]; then
  K1_ROUNDS=1 AB_TIMEOUT=${AB_TIMEOUT:-250} bash benchmarks/k1_candidates_call.sh
else
  timeout ${SANITIZE_TIMEOUT:-250} env SANITIZER_TOOLS=memcheck SANITIZE_SCRIPT=benchmarks/past_int32_sanitize.py \
    PAST_INT32_CASES="cuda and gradients and state" SANITIZER_TIMEOUT=$((${SANITIZE_TIMEOUT:-250} - 10)) \
    OUT=$OUT/sanitize bash benchmarks/gpu_session.sh sanitize 2>&1 | tail -8
fi
