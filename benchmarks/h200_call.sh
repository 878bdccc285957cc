#!/usr/bin/env bash
# One device call (2026-12-06): on an H200, the tests past 2^31 elements, among them the training
# case whose inputs pass 2^31 (it runs only on a GPU of 125 GB or more; run 180 ran it out of
# memory; without the test's copy of its inputs and with e2a9e96's order it should take about
# 117 GiB), then the K1 candidates' A/B in one round (k1_candidates_call.sh; K1 is
# instruction-bound only on an H200).
# On an H100: six_call.sh's branch for it (the whole suite).
# Carries: .whl, .kernels and the five K1 candidate folders (.kernels-wtf32, -so, -atf32, -aw, -all3).
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[[ $card == *H200* ]] || exec bash benchmarks/six_call.sh
BIGMEM_TIMEOUT=${BIGMEM_TIMEOUT:-240} PER_TEST_TIMEOUT=210 OUT=$OUT bash benchmarks/gpu_session.sh bigmem 2>&1 | tail -12
K1_ROUNDS=1 AB_TIMEOUT=${K1_TIMEOUT:-280} bash benchmarks/k1_candidates_call.sh
