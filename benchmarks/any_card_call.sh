#!/usr/bin/env bash
# One device call on whichever card comes (2026-12-07): on an H200 the pending call of
# h200_call2.sh (the K1 candidates' A/B, the decode trace, the NaN tests, bigmem); on any other
# card the whole suite (gpu_session.sh tests). Carries: as h200_call2.sh.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card == *H200* ]]; then
  timeout 565 bash benchmarks/h200_call2.sh
else
  WORKERS=14 TEST_TIMEOUT=480 BIGMEM=0 PER_TEST_TIMEOUT=300 timeout 560 bash benchmarks/gpu_session.sh tests 2>&1 | tail -40
fi
