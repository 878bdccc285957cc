#!/usr/bin/env bash
# One device call (2026-12-06, run 170 on an H100): the decode kernel with six bf16 whole-head CTAs an
# SM (.kernels-six: `bash benchmarks/build_kernels.sh .kernels-six HEAD -DKDA_DECODE_OVERLAY=1`)
# against five (.kernels, the default build): its GPU decode and pool tests, then the decode A/B;
# then on an H200 the K1 candidates' A/B in one round (k1_candidates_call.sh), on an H100 what that
# script does there. Carries: .whl, .kernels, .kernels-six and the five K1 candidate folders
# (.kernels-wtf32, -so, -atf32, -aw, -all3).
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 120 env KERNELS=.kernels-six TESTS="tests/test_cuda_decode.py tests/test_pools.py" BIGMEM=0 WORKERS=14 \
  TEST_TIMEOUT=110 OUT=$OUT/six-tests bash benchmarks/gpu_session.sh tests 2>&1 | tail -6
timeout 150 env DECODE_AB_DIRS=".kernels .kernels-six" DECODE_AB_SIZES="32 256 1024" DECODE_AB_WIDTHS="bfloat16:128" \
  OUT=$OUT bash benchmarks/gpu_session.sh decodeab 2>&1 | tail -12
tar czf "$OUT/six-tests.tgz" -C "$OUT" six-tests && rm -rf "$OUT/six-tests"
K1_ROUNDS=1 AB_TIMEOUT=${K1_TIMEOUT:-290} SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-150} bash benchmarks/k1_candidates_call.sh
