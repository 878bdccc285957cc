#!/usr/bin/env bash
# One device call (2026-12-06): the whole suite on the tree with walking decode CTAs (80e4b91) and the
# far twin on by default (64dcbef), then the decode A/B of walking CTAs on bf16 whole heads:
# the build before the walk (.kernels-prewalk), this build with one CTA an item, and with the
# resident grid (KDA_CUDA_DECODE_GRID=resident). Carries: .whl, .kernels, .kernels-prewalk.
set -uo pipefail
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${SUITE_TIMEOUT:-400} env BIGMEM=0 WORKERS=14 TEST_TIMEOUT=${TEST_TIMEOUT:-400} PER_TEST_TIMEOUT=300 OUT=$OUT \
  bash benchmarks/gpu_session.sh tests 2>&1 | tail -25
timeout ${AB_TIMEOUT:-170} env DECODE_AB_DIRS=".kernels-prewalk .kernels .kernels:KDA_CUDA_DECODE_GRID=resident" \
  DECODE_AB_SIZES="32 256 1024" DECODE_AB_WIDTHS="bfloat16:128" OUT=$OUT bash benchmarks/gpu_session.sh decodeab 2>&1 | tail -20
PYTHONPATH=src python3 benchmarks/decode_ab.py --summary "$OUT/decode-ab.jsonl"
