#!/usr/bin/env bash
# One device call for the K1 candidates and the far entry point's wgmma twin (benchmarks/NOTES.md,
# "Next device plan (after this session)", 2026-12-05), whichever card comes.
#
# An H200: the A/B of seven builds (K1 is instruction-bound there, runs 132, 144, 161), the only
# card where the candidates can win. An H100 (K1 bound by memory there): what it can still say,
#   1. the CUDA and launch tests, which hold the far twin's first GPU tests;
#   2. `kda bench` case 7 (the released model's precomputed gate) beside fla, with the switch off
#      and on (the switch changes K2, not K1: its gain can show on either card);
#   3. four builds' executed instructions on 1x8192 H96 by ncu (the H200's K1 time follows them).
# Every log goes back as one archive ($OUT/k1-call.tgz) beside the A/B's lines: at most 8 files
# come back from $OUT.
# Carries: .whl, .kernels, .kernels-wtf32, .kernels-so, .kernels-atf32, .kernels-aw, .kernels-all3.
set -uo pipefail
OUT=${OUT:-/tmp/out}
builds=("" -wtf32 -so -atf32 -aw -all3)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card == *H200* ]]; then
  # (the far twin is the default since 64dcbef: the second column is the mma.sync K2 for the far gates)
  ab=".kernels:auto .kernels:auto:KDA_CUDA_FAR_WGMMA=0"
  for b in "${builds[@]:1}"; do ab+=" .kernels$b:auto"; done
  timeout ${AB_TIMEOUT:-540} env AB_LONG_CASES=1,3 WIDTH_AB="$ab" WIDTH_AB_ROUNDS=2 OUT=$OUT \
    bash benchmarks/gpu_session.sh widthab 2>&1 | tail -40
  # (the summary again: a call cut short by the timeout never printed it; the lines are in $OUT)
  PYTHONPATH=src python3 benchmarks/prepare_ab.py --summary "$OUT/width-ab.jsonl"
  exit 0
fi
work=/tmp/k1-call
mkdir -p "$work"
timeout 230 env TESTS="tests/test_cuda.py tests/test_cuda_launch.py" BIGMEM=0 WORKERS=14 TEST_TIMEOUT=200 \
  OUT=$work/tests bash benchmarks/gpu_session.sh tests 2>&1 | tail -12
for far in 0 1; do
  impls=kda-cuda,fla
  [[ $far == 1 ]] && impls=kda-cuda
  timeout 120 env KDA_CUDA_FAR_WGMMA=$far BENCH_ARGS="--impls $impls --cases 7" BENCH_TIMEOUT=110 \
    OUT=$work/bench-far$far bash benchmarks/gpu_session.sh bench 2>&1 | tail -6
done
# (four builds: default, A, A and w, all three; about 45 s each)
for b in "" -atf32 -aw -all3; do
  timeout 50 env KERNELS=.kernels$b OUT=$work/k1$b PROFILE_PARTS=k1src bash benchmarks/gpu_session.sh profile \
    2>&1 | grep -i "executed instructions" | head -4 | sed "s/^/.kernels$b: /"
done
cp "$work/tests/triton-autotune-cards.tgz" "$OUT/" 2>/dev/null
tar czf "$OUT/k1-call.tgz" -C /tmp k1-call
