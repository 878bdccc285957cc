#!/usr/bin/env bash
# One device call (branch split-output-tiles-2026-12-05): the split's outputs' kernel
# (kda.triton.segments.add_entering_states) at several tile counts and both program orders, in
# alternating processes on the 2M H8 call (benchmarks/long_profile.py: its add_entering_states_kernel
# line and the call's wall time), two rounds; then its CPU/GPU test. KERNELS: the carried build.
#   VARIANTS="1,0 4,0 8,0 1,1 4,1" (tiles,heads_first)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/ab
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 KDA_CUDA_KERNELS_DIR=$PWD/${KERNELS:-.kernels}
trap '(cd /tmp/ab && tar czf "$OUT/output-tiles-ab.tgz" .)' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv | tee /tmp/ab/gpu.txt
for round in 1 2; do
  for variant in ${VARIANTS:-1,0 4,0 8,0 1,1 4,1}; do
    tiles=${variant%,*} first=${variant#*,}
    KDA_SPLIT_OUTPUT_TILES=$tiles KDA_SPLIT_OUTPUT_HEADS_FIRST=$first timeout 90 python3 benchmarks/long_profile.py 3 \
      > /tmp/ab/profile-t$tiles-h$first-r$round.log 2>&1
    echo "round $round tiles $tiles heads_first $first: exit $?"
    grep -E '^wall|add_entering' /tmp/ab/profile-t$tiles-h$first-r$round.log
  done
done
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_segments.py > /tmp/ab/pytest-segments.log 2>&1
echo "pytest: exit $?"; tail -2 /tmp/ab/pytest-segments.log
