#!/usr/bin/env bash
# Device calls for the tf32 K1 (A and w in one tf32 product, K1's stores from one offset a thread,
# the NaN guard on A's left operand: prepare.cu's three candidates together; benchmarks/NOTES.md,
# 2026-12-07). Carries .whl and the builds it names (benchmarks/build_kernels.sh):
#   .kernels-tf32a  build_kernels.sh .kernels-tf32a HEAD -DKDA_K1_A_TF32=1 -DKDA_K1_W_TF32=1 -DKDA_K1_STORE_OFFSETS=1
#   .kernels-tf32   the same flags on a56bf1c, before the guard (run 213's build)
#   .kernels        the default (3xTF32 A and w)
# K1_STEPS (default "nan suite"), in this order:
#   nan    tests/test_nan.py on .kernels-tf32a first (run 213's two failures must pass), so that a
#          call cut short still answers the question the merge waits on;
#   ab     prepare_ab.py of the three builds (K1_ROUNDS rounds, default 2): the two tf32 builds'
#          hashes must match (the guard changes no finite result), their times say what it costs;
#   suite  the whole suite on .kernels-tf32a (gpu_session.sh tests; TEST_TIMEOUT, default 430);
#   bench  kda bench on .kernels-tf32a beside fla in the same process (FLA_FLASH_KDA=0): the anchor
#          cases 0-3, then --long --cases ${BENCH_LONG:-3,1,0}; results and logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
steps=" ${K1_STEPS:-nan suite} "
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $steps == *" nan "* ]]; then  # (its own folder: the suite's logs archive has the same name)
  TESTS=tests/test_nan.py KERNELS=.kernels-tf32a TEST_TIMEOUT=${NAN_TIMEOUT:-120} BIGMEM=0 OUT=$OUT/nan \
    bash benchmarks/gpu_session.sh tests 2>&1 | tail -6
fi
if [[ $steps == *" ab "* ]]; then
  # (gpu_session.sh prints the summary; a call cut short by the timeout never did, so then here)
  timeout ${AB_TIMEOUT:-300} env WIDTH_AB=".kernels-tf32:auto .kernels-tf32a:auto .kernels:auto" \
    WIDTH_AB_ROUNDS=${K1_ROUNDS:-2} OUT=$OUT bash benchmarks/gpu_session.sh widthab 2>&1 | tail -20 ||
    PYTHONPATH=src python3 benchmarks/prepare_ab.py --summary "$OUT/width-ab.jsonl"
fi
if [[ $steps == *" suite "* ]]; then
  KERNELS=.kernels-tf32a WORKERS=14 TEST_TIMEOUT=${TEST_TIMEOUT:-430} BIGMEM=0 PER_TEST_TIMEOUT=300 OUT=$OUT \
    bash benchmarks/gpu_session.sh tests 2>&1 | tail -25
fi
if [[ $steps == *" bench "* ]]; then
  # (results and logs of both runs in one archive: at most 8 files come back from $OUT)
  b=$OUT/bench-tf32a; mkdir -p "$b"
  KERNELS=.kernels-tf32a BENCH_ARGS="--impls kda-cuda,fla --cases 0,1,2,3 --tag=-tf32a" BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} \
    OUT=$b bash benchmarks/gpu_session.sh bench 2>&1 | tail -16
  mv "$b/logs-bench.tgz" "$b/logs-bench-anchors.tgz"
  KERNELS=.kernels-tf32a BENCH_ARGS="--long --impls kda-cuda,fla --cases ${BENCH_LONG:-3,1,0} --tag=-tf32a-long" \
    BENCH_TIMEOUT=${LONG_TIMEOUT:-250} OUT=$b bash benchmarks/gpu_session.sh bench 2>&1 | tail -16
  mv "$b/triton-autotune-cards.tgz" "$OUT/"
  tar czf "$OUT/bench-tf32a.tgz" -C "$OUT" bench-tf32a && rm -rf "$b"
fi
