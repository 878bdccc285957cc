#!/usr/bin/env bash
# One device call (2026-12-06, run 170 on an H100): on an H100 the whole suite (run 170 had the
# six-CTA decode build's parts, runs 171-172 the memcheck past 2^31); on an H200 h200_call.sh (the
# decode with six bf16 whole-head CTAs an SM, .kernels-six: `bash benchmarks/build_kernels.sh
# .kernels-six HEAD -DKDA_DECODE_OVERLAY=1`, against five, then the K1 candidates' A/B). Carries: .whl,
# .kernels, .kernels-six and the five K1 candidate folders (.kernels-wtf32, -so, -atf32, -aw, -all3).
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $card != *H200* ]]; then
  # An H100 had this call's decode parts in run 170 and the memcheck past 2^31 in runs 171-172: give it
  # the whole suite on the current tree (the last whole-suite run on a GPU was run 169, before 56b6c5c).
  # 400 s: 330 cut run 176 at 686 of 699 tests; run 177 took 373 s, its bigmem tests 27.
  WORKERS=14 TEST_TIMEOUT=400 PER_TEST_TIMEOUT=300 BIGMEM_TIMEOUT=150 OUT=$OUT bash benchmarks/gpu_session.sh tests 2>&1 | tail -12
  exit 0
fi
# On an H200: h200_call.sh (the decode A/B and the six-CTA build's decode bench, then the K1 A/B; the
# six-CTA build's tests are h200_followup.sh's).
exec bash benchmarks/h200_call.sh
