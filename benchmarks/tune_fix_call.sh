#!/usr/bin/env bash
# One device call (2026-12-06, after run 171): chunk_input_grads_kernel's restore_value on a GPU.
# Run 171's memcheck step (no KDA_TRITON_AUTOTUNE=0, a cold cache for its key) tuned that kernel,
# which rewrites two of its inputs, and the training test past 2^31 got dq of order 1e-23. First
# the backward's and CUDA training's GPU tests (test_autotuning_leaves_every_result_alone among
# them, CUDA and Triton), then on an H200 the K1 candidates' A/B in one round, the likeliest
# winners first (an A/B cut short still says what it timed); on an H100 the memcheck of the
# training case past 2^31 again. Carries: .whl, .kernels and the five K1 candidate folders.
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
timeout ${TRAIN_TESTS_TIMEOUT:-170} env TESTS="tests/test_backward.py tests/test_cuda_training.py" BIGMEM=0 WORKERS=14 \
  TEST_TIMEOUT=$((${TRAIN_TESTS_TIMEOUT:-170} - 10)) OUT=$OUT/train-tests bash benchmarks/gpu_session.sh tests 2>&1 | tail -8
tar czf "$OUT/train-tests.tgz" -C "$OUT" train-tests && rm -rf "$OUT/train-tests"
if [[ $card == *H200* ]]; then
  ab=".kernels:auto"
  for b in -all3 -aw -atf32 -wtf32 -so; do ab+=" .kernels$b:auto"; done
  timeout ${AB_TIMEOUT:-250} env AB_LONG_CASES=1,3 WIDTH_AB="$ab" WIDTH_AB_ROUNDS=1 OUT=$OUT \
    bash benchmarks/gpu_session.sh widthab 2>&1 | tail -30
  PYTHONPATH=src python3 benchmarks/prepare_ab.py --summary "$OUT/width-ab.jsonl"
else
  timeout ${SANITIZE_TIMEOUT:-250} env SANITIZER_TOOLS=memcheck SANITIZE_SCRIPT=benchmarks/past_int32_sanitize.py \
    PAST_INT32_CASES="cuda and gradients and state" SANITIZER_TIMEOUT=$((${SANITIZE_TIMEOUT:-250} - 10)) \
    OUT=$OUT/sanitize bash benchmarks/gpu_session.sh sanitize 2>&1 | tail -8
fi
