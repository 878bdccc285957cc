#!/usr/bin/env bash
# One device call on an H200 (2026-12-06, after runs 192-193, which ran the six-CTA decode A/B and
# the whole suite without its bigmem tests there): first the bigmem tests, whose 125 GB training
# case only an H200's memory holds and which has never run to its end; then the K1 candidates' A/B
# (k1_candidates_call.sh: K1 is instruction-bound only on an H200, runs 132, 144, 161).
# Carries: .whl, .kernels and the K1 candidate folders (.kernels-wtf32, -so, -atf32, -aw, -all3).
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $card != *H200* ]]; then
  echo "card: $card; this call is for an H200 (neither step says anything on an H100)" >&2
  exit 2
fi
BIGMEM_TIMEOUT=${BIGMEM_TIMEOUT:-250} PER_TEST_TIMEOUT=240 OUT=$OUT bash benchmarks/gpu_session.sh bigmem 2>&1 | tail -24
K1_ROUNDS=${K1_ROUNDS:-1} AB_TIMEOUT=${K1_TIMEOUT:-280} bash benchmarks/k1_candidates_call.sh
