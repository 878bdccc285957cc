#!/usr/bin/env bash
# A short device call on an H200 (2026-12-07, for a session with little device time left):
# tests/test_nan.py on the tree's kernels (.kernels), the K1 A/B of the default against the two
# likeliest candidates (all3, aw), then the decode graph trace if time is left.
# Carries: .whl, .kernels, .kernels-all3, .kernels-aw, .kernels-trace.
set -uo pipefail
OUT=${OUT:-/tmp/out}
CALL_SECONDS=${CALL_SECONDS:-330}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[[ $card == *H200* ]] || exit 2
mkdir -p "$OUT"
(source benchmarks/site_wheels.sh
 PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels KDA_TRITON_AUTOTUNE=0 timeout ${NAN_TIMEOUT:-70} \
   python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_nan.py > "$OUT/pytest-nan.log" 2>&1; tail -4 "$OUT/pytest-nan.log")
echo "== K1 A/B ($SECONDS s in)"
K1_BUILDS="-all3 -aw" K1_FAR=0 K1_ROUNDS=1 AB_TIMEOUT=${K1_TIMEOUT:-200} OUT=$OUT/k1 \
  bash benchmarks/k1_candidates_call.sh 2>&1 | tail -30
left=$((CALL_SECONDS - SECONDS - 10))
echo "== decode trace ($SECONDS s in, $left s left)"
if ((left > 40)); then
  (source benchmarks/site_wheels.sh
   PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels-trace timeout $left python3 benchmarks/decode_trace.py 256 \
     > "$OUT/decode-trace.jsonl" 2>&1; tail -4 "$OUT/decode-trace.jsonl")
fi
