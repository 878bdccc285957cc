#!/usr/bin/env bash
# One device call on an H200 (2026-12-07): the K1 candidates' A/B (k1_candidates_call.sh, issue 13),
# then the decode trace of launches captured in one graph (decode_trace.py, issue 12's pool gap;
# carry .kernels-trace, a -DKDA_DECODE_TRACE=1 build), tests/test_nan.py (.kernels: the tree's
# build), then the bigmem tests in what is left of CALL_SECONDS.
# Carries: .whl, .kernels, the five K1 folders, .kernels-trace. With little device time:
#   CALL_SECONDS=330 K1_TIMEOUT=200 K1_BUILDS="-all3 -aw" K1_FAR=0 bash benchmarks/h200_call2.sh
# (the default against the two likeliest candidates; no bigmem; carry .kernels-all3 and -aw only).
set -uo pipefail
OUT=${OUT:-/tmp/out}
CALL_SECONDS=${CALL_SECONDS:-560}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $card != *H200* ]]; then
  echo "card: $card; this call is for an H200" >&2
  exit 2
fi
K1_ROUNDS=${K1_ROUNDS:-1} AB_TIMEOUT=${K1_TIMEOUT:-300} OUT=$OUT/k1 bash benchmarks/k1_candidates_call.sh 2>&1 | tail -45
source benchmarks/site_wheels.sh
echo "== decode trace ($SECONDS s in)"
PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels-trace timeout 90 python3 benchmarks/decode_trace.py 256 \
  > "$OUT/decode-trace.jsonl" 2>&1
tail -4 "$OUT/decode-trace.jsonl"
echo "== NaN tests ($SECONDS s in)"
PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels KDA_TRITON_AUTOTUNE=0 timeout ${NAN_TIMEOUT:-100} \
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_nan.py > "$OUT/pytest-nan.log" 2>&1
tail -4 "$OUT/pytest-nan.log"
left=$((CALL_SECONDS - SECONDS - 15))
if [[ -n ${TESTS_AFTER:-} ]]; then  # (2026-12-07) test files of the tree in the time left, in place of bigmem
  echo "== $TESTS_AFTER ($SECONDS s in, $left s left)"
  PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels FLA_FLASH_KDA=0 timeout $((left - 5)) \
    python3 -m pytest -q -n 8 -p no:cacheprovider -rfs $TESTS_AFTER > "$OUT/pytest-after.log" 2>&1
  tail -6 "$OUT/pytest-after.log"
  left=0
fi
echo "== bigmem ($SECONDS s in, $left s left)"
if ((left > 60)); then
  BIGMEM_TIMEOUT=$((left - 10)) PER_TEST_TIMEOUT=$((left - 20)) OUT=$OUT/bigmem timeout $left \
    bash benchmarks/gpu_session.sh bigmem 2>&1 | tail -24
fi
