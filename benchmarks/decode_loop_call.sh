#!/usr/bin/env bash
# One device call (2026-12-07): decode.cu's item loop (a CTA through items a grid apart, each
# item's slot index loaded during the one before), built from the working tree in .kernels-loop:
# its decode tests, then its A/B in alternating processes against the build before it (.kernels)
# at one CTA an item and at the CTAs the SMs hold (bf16 whole heads 5 an SM, float32 64 columns
# 6: decode_ctas_per_sm), then `kda bench --decode --quick` on it (issue 12's table, the bf16
# plain rows under equal work). Carries: .whl, .kernels, .kernels-loop.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
source benchmarks/site_wheels.sh
mkdir -p "$OUT/ab"  # (the test log goes back in the A/B's log archive: at most 8 files come back)
PYTHONPATH=/tmp/site:$PWD/src KDA_CUDA_KERNELS_DIR=$PWD/.kernels-loop KDA_TRITON_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-150} \
  python3 -m pytest -q -n 8 -p no:cacheprovider -rfs tests/test_cuda_decode.py > "$OUT/ab/pytest-decode-loop.log" 2>&1
tail -5 "$OUT/ab/pytest-decode-loop.log"
echo "== A/B ($SECONDS s in)"
DECODE_AB_WIDTHS="bfloat16:128 float32:64" DECODE_AB_SIZES="32 256 1024" \
  DECODE_AB_DIRS=".kernels .kernels-loop .kernels-loop:DECODE_AB_CTAS_PER_SM=bfloat16=5,float32=6" \
  OUT=$OUT/ab timeout ${AB_TIMEOUT:-240} bash benchmarks/gpu_session.sh decodeab 2>&1 | tail -24
[[ ${BENCH:-1} == 1 ]] || exit 0  # (BENCH=0: not on an H100, whose figures are not issue 12's)
echo "== bench ($SECONDS s in)"
KERNELS=.kernels-loop DECODE_TIMEOUT=${DECODE_TIMEOUT:-180} DECODE_ARGS=--quick OUT=$OUT/bench \
  timeout $((${DECODE_TIMEOUT:-180} + 20)) bash benchmarks/gpu_session.sh decode 2>&1 | tail -30
echo "done at $SECONDS s"
