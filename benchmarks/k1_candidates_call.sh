#!/usr/bin/env bash
# One device call for the K1 candidates and the far entry point's wgmma twin (benchmarks/NOTES.md,
# "Next device plan (after this session)", 2026-12-05), whichever card comes.
#
# An H200: the A/B of seven builds (K1 is instruction-bound there, runs 132, 144, 161), the only
# card where the candidates can win. An H100 (K1 bound by memory there): what is left for it (below).
# Every log goes back as one archive ($OUT/k1-call.tgz) beside the A/B's lines: at most 8 files
# come back from $OUT.
# Carries: .whl, .kernels, .kernels-wtf32, .kernels-so, .kernels-atf32, .kernels-aw, .kernels-all3.
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card == *H200* ]]; then
  # The likeliest winners first (an A/B cut short still says what it timed; 2026-12-06); last, the
  # mma.sync K2 for the far gates (the far twin is the default since 64dcbef).
  # (K1_BUILDS="-all3 -aw" and K1_FAR=0: a shorter A/B for a call with little device time, 2026-12-07)
  ab=".kernels:auto"
  for b in ${K1_BUILDS:--all3 -aw -atf32 -wtf32 -so}; do ab+=" .kernels$b:auto"; done
  [[ ${K1_FAR:-1} == 1 ]] && ab+=" .kernels:auto:KDA_CUDA_FAR_WGMMA=0"
  timeout ${AB_TIMEOUT:-540} env AB_LONG_CASES=1,3 WIDTH_AB="$ab" WIDTH_AB_ROUNDS=${K1_ROUNDS:-2} OUT=$OUT \
    bash benchmarks/gpu_session.sh widthab 2>&1 | tail -40
  # (the summary again: a call cut short by the timeout never printed it; the lines are in $OUT)
  PYTHONPATH=src python3 benchmarks/prepare_ab.py --summary "$OUT/width-ab.jsonl"
  exit 0
fi
work=/tmp/k1-call
mkdir -p "$work"
# An H100 after run 168 (which ran the CUDA tests, case 7 with the twin off and on, and K1's
# instructions) and run 169 (the whole suite): case 7 with the twin on (the default since 64dcbef)
# beside fla in the same process, then the memcheck of the CUDA cases past 2^31 elements
# (benchmarks/past_int32_sanitize.py), never run yet.
timeout 120 env BENCH_ARGS="--impls kda-cuda,fla --cases 7" BENCH_TIMEOUT=110 OUT=$work/bench-far1 \
  bash benchmarks/gpu_session.sh bench 2>&1 | tail -6
timeout ${SANITIZE_TIMEOUT:-420} env SANITIZER_TOOLS=memcheck SANITIZE_SCRIPT=benchmarks/past_int32_sanitize.py \
  SANITIZER_TIMEOUT=400 OUT=$work/sanitize bash benchmarks/gpu_session.sh sanitize 2>&1 | tail -8
tar czf "$OUT/k1-call.tgz" -C /tmp k1-call
