#!/usr/bin/env bash
# One device call (2026-12-05): the segment split's two transition runs in one wgmma K2 launch
# (kda.cuda.forward.runs_kind) against a launch a run (KDA_CUDA_PAIRED_RUNS=0). The GPU tests of
# both paths, `kda bench --long` on the split cases in alternating processes (two rounds), fla
# beside, and the 2M H8 call's kernels under each (benchmarks/long_profile.py). KERNELS: the
# carried build. Everything comes back in $OUT as one archive of logs and results.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/ab
source benchmarks/site_wheels.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 KDA_CUDA_KERNELS_DIR=$PWD/${KERNELS:-.kernels}
source benchmarks/autotune_cache.sh  # (one cache a card)
trap 'save_autotune; (cd /tmp/ab && tar czf "$OUT/paired-runs-ab.tgz" .)' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee /tmp/ab/gpu.txt
TRITON_CACHE_DIR=$TESTS_TRITON_CACHE_DIR timeout ${AB_TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_launch.py \
  tests/test_cuda.py tests/test_segments.py -k "shared_runs or wgmma_runs or split or segment" \
  > /tmp/ab/pytest-paired-runs.log 2>&1; echo "pytest: exit $?"; tail -4 /tmp/ab/pytest-paired-runs.log
for round in 1 2; do
  for paired in 0 1; do
    KDA_CUDA_PAIRED_RUNS=$paired timeout 150 python3 -m kda bench --long --cases ${AB_CASES:-2,3,4,5} --impls kda-cuda \
      --out /tmp/ab --tag=-paired$paired-r$round > /tmp/ab/bench-long-paired$paired-r$round.log 2>&1
    echo "round $round paired $paired: exit $?"; grep -E 'kda-cuda: ' /tmp/ab/bench-long-paired$paired-r$round.log
  done
done
timeout 200 python3 -m kda bench --long --cases ${FLA_CASES:-2,3} --impls kda-cuda,fla --out /tmp/ab --tag=-paired-fla \
  > /tmp/ab/bench-long-fla.log 2>&1; echo "beside fla: exit $?"; tail -12 /tmp/ab/bench-long-fla.log
for paired in 0 1; do
  KDA_CUDA_PAIRED_RUNS=$paired timeout 120 python3 benchmarks/long_profile.py 3 > /tmp/ab/long-profile-paired$paired.log 2>&1
  echo "profile paired $paired: exit $?"; grep -v '^{' /tmp/ab/long-profile-paired$paired.log | head -14
done
