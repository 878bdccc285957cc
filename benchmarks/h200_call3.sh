#!/usr/bin/env bash
# One device call on an H200 (2026-12-07, from 13:53): `kda bench --decode --quick` (issue 12's rows on the
# H200 with 259ef12's bf16 -> float32 kernel beside fla), then the K1 candidates' A/B against the default
# (k1_candidates_call.sh, one round, issue 13) in the time left (an A/B cut short still says what it
# timed), then, if time is left, the pool by slot order with torch's gather and scatter of the slots by
# the same orders (pool_order.py 256; run 210 ran the copies as slot_order_copy.py, 5c25335) and the
# decode trace of a plain call and a pool (decode_trace.py 256, .kernels-trace: where the pool's 3 us
# outside its CTAs go). Run 210 ran it.
# Carries: .whl, .kernels, .kernels-all3, .kernels-aw, .kernels-trace. (The decode step 200 s since 58c371a added
# the random-slot pool rows.)
set -uo pipefail
export OUT=${OUT:-/tmp/out}
CALL_SECONDS=${CALL_SECONDS:-585}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card != *H200* ]]; then
  echo "this call is for an H200" >&2
  exit 2
fi
DECODE_ARGS=--quick DECODE_TIMEOUT=200 timeout 215 bash benchmarks/gpu_session.sh decode 2>&1 \
  | grep -v '^| [a-z0-9]* | [a-z_0-9]* | [0-9]* | [a-z_]* |' | tail -30
k1=$((CALL_SECONDS - SECONDS - 10))
k1=$((k1 > ${K1_TIMEOUT:-230} ? ${K1_TIMEOUT:-230} : k1))
echo "== K1 A/B ($SECONDS s in, $k1 s for it)"
K1_ROUNDS=1 K1_BUILDS="-all3 -aw" K1_FAR=0 AB_TIMEOUT=$k1 OUT=$OUT/k1 timeout $((k1 + 8)) \
  bash benchmarks/k1_candidates_call.sh 2>&1 | tail -25
left=$((CALL_SECONDS - SECONDS - 5))
echo "== pool order, decode trace ($SECONDS s in, $left s left)"
if ((left > 30)); then
  source benchmarks/site_wheels.sh
  # (one file for both: at most 8 come back)
  PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels timeout $left python3 benchmarks/pool_order.py 256 3 \
    > "$OUT/decode-trace.jsonl" 2>&1
  tail -c 1500 "$OUT/decode-trace.jsonl"
  left=$((CALL_SECONDS - SECONDS - 5))
  ((left > 20)) && PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels-trace timeout $left \
    python3 benchmarks/decode_trace.py 256 >> "$OUT/decode-trace.jsonl" 2>&1
  tail -c 3000 "$OUT/decode-trace.jsonl"
fi
