#!/usr/bin/env bash
# One device call on an H200 (2026-12-06, reordered at 13:10 for a session with device time for
# about one and a half calls): first what can close issue 12, the six-CTA decode build against the
# default (decode A/B, bf16 whole heads) and `kda bench --decode --quick` with the six-CTA build
# (its bf16 pools at N=256 against the copy bandwidth, the bar's own figure); then the K1
# candidates' A/B in one round (K1 is instruction-bound only on an H200). The whole suite with its
# bigmem tests (the 125 GB training case) is the next call's: gpu_session.sh tests.
# On an H100: six_call.sh's branch for it (the whole suite).
# Carries: .whl, .kernels, .kernels-six and the five K1 candidate folders (.kernels-wtf32, -so,
# -atf32, -aw, -all3).
set -uo pipefail
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# ON_H100=mutation (2026-12-06, runs 183-184, a session whose H200 starts kept failing, asking without
# needs_h200): an H100 runs the mutation check alone, a few minutes of device time, instead of the whole suite.
if [[ $card != *H200* && ${ON_H100:-suite} == mutation ]]; then
  source benchmarks/site_wheels.sh
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  KDA_CUDA_KERNELS_DIR=$PWD/.kernels FLA_FLASH_KDA=0 timeout 200 bash benchmarks/order_mutation.sh 2>&1 | tail -8
  exit 0
fi
[[ $card == *H200* ]] || exec bash benchmarks/six_call.sh
# At most 8 files come back: the results travel as one archive beside the steps' log archives.
trap '(cd "$OUT" && shopt -s nullglob && f=(*.json *.jsonl *.md) && ((${#f[@]})) && tar czf results.tgz "${f[@]}" && rm -f "${f[@]}")' EXIT
timeout 150 env DECODE_AB_DIRS=".kernels .kernels-six" DECODE_AB_SIZES="32 256 1024" DECODE_AB_WIDTHS="bfloat16:128" \
  OUT=$OUT bash benchmarks/gpu_session.sh decodeab 2>&1 | tail -12
timeout ${DECODE_TIMEOUT:-170} env KERNELS=.kernels-six DECODE_ARGS="--quick --tag=-${RUN:-run}-six" \
  OUT=$OUT bash benchmarks/gpu_session.sh decode 2>&1 | tail -40
# the backward order test's GPU byte check against a mutant that keeps the state gradients' storage
# (MUTATION=0: skipped, as after run 184 saw it fail on an H100, 2026-12-06, at 2009c99)
[[ ${MUTATION:-1} == 1 ]] && KDA_CUDA_KERNELS_DIR=$PWD/.kernels timeout 120 bash benchmarks/order_mutation.sh 2>&1 | tail -8
# (K1=0: skipped, for a call whose device time is short: the candidates cannot close issue 13's bars)
[[ ${K1:-1} == 1 ]] && K1_ROUNDS=1 AB_TIMEOUT=${K1_TIMEOUT:-200} bash benchmarks/k1_candidates_call.sh
