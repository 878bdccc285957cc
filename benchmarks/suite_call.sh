#!/usr/bin/env bash
# One device call (2026-12-07): the whole suite on whichever card comes (the tree's GPU check),
# then, on an H200 only, K1's likeliest candidate build (.kernels-all3) against the default in
# the time left (k1_candidates_call.sh's A/B, one round; K1 is bound by memory on an H100, where
# the A/B cannot decide). Carries: .whl (with the autotune archive), .kernels, .kernels-all3.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
CALL_SECONDS=${CALL_SECONDS:-560}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
WORKERS=14 TEST_TIMEOUT=$TEST_TIMEOUT BIGMEM=0 PER_TEST_TIMEOUT=300 timeout $((TEST_TIMEOUT + 20)) \
  bash benchmarks/gpu_session.sh tests 2>&1 | tail -30
left=$((CALL_SECONDS - SECONDS - 10))
echo "== K1 A/B? ($SECONDS s in, $left s left)"
if [[ $card == *H200* ]] && ((left > 90)); then
  K1_ROUNDS=1 K1_BUILDS="-all3" K1_FAR=0 AB_TIMEOUT=$((left - 10)) OUT=$OUT/k1 timeout $left \
    bash benchmarks/k1_candidates_call.sh 2>&1 | tail -20
fi
