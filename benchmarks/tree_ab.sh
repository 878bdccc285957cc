#!/usr/bin/env bash
# One device call: the Python of two trees on the same kernels, in alternating processes
# (2026-12-05: the split's host copies through pinned memory against 7ee81ca's pageable ones).
#   BASE=.base/src (a `git archive REV src` of the baseline, carried) against the tree's src;
#   the 2M H8 call's kernels and wall time (benchmarks/long_profile.py) and `kda bench --long`
#   on AB_CASES, ROUNDS rounds; fla beside the tree once; then, with SUITE=1, the whole suite
#   on the tree (SUITE_TIMEOUT; SUITE_TESTS: pytest's arguments in its place). Logs and results
#   come back as one archive.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/ab
source benchmarks/site_wheels.sh
export PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 KDA_CUDA_KERNELS_DIR=$PWD/${KERNELS:-.kernels}
source benchmarks/autotune_cache.sh  # (one cache a card)
trap 'save_autotune; (cd /tmp/ab && tar czf "$OUT/tree-ab.tgz" .)' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee /tmp/ab/gpu.txt
base=$PWD/${BASE:-.base/src}
for round in $(seq ${ROUNDS:-2}); do
  for tree in base tree; do
    src=$PWD/src; [[ $tree == base ]] && src=$base
    PYTHONPATH=/tmp/site:$src timeout 90 python3 benchmarks/long_profile.py 3 > /tmp/ab/profile-$tree-r$round.log 2>&1
    echo "round $round $tree profile: exit $?"; grep -E '^wall|kda_recurrence|add_entering|prepare' /tmp/ab/profile-$tree-r$round.log
    PYTHONPATH=/tmp/site:$src timeout 90 python3 -m kda bench --long --cases ${AB_CASES:-3,5} --impls kda-cuda \
      --out /tmp/ab --tag=-$tree-r$round > /tmp/ab/bench-long-$tree-r$round.log 2>&1
    echo "round $round $tree bench: exit $?"; grep -E 'kda-cuda: ' /tmp/ab/bench-long-$tree-r$round.log
  done
done
export PYTHONPATH=/tmp/site:$PWD/src
timeout 120 python3 -m kda bench --long --cases ${FLA_CASES:-3} --impls kda-cuda,fla --out /tmp/ab --tag=-fla \
  > /tmp/ab/bench-long-fla.log 2>&1; echo "beside fla: exit $?"; grep -E '^\| 1x' /tmp/ab/bench-long-fla.log
if [[ ${SUITE:-0} == 1 ]]; then
  # (as gpu_session.sh's tests step: -v logs each result as it lands, so a run cut short says what passed)
  KDA_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR=$TESTS_TRITON_CACHE_DIR timeout ${SUITE_TIMEOUT:-400} python3 -m pytest -v -rfE -n ${WORKERS:-14} -p no:cacheprovider \
    --timeout 300 ${SUITE_TESTS:-tests} > /tmp/ab/pytest-gpu.log 2>&1; echo "suite: exit $?"
  grep -E "FAILED|ERROR|passed|failed" /tmp/ab/pytest-gpu.log | grep -v PASSED | tail -8
fi
