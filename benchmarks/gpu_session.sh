#!/usr/bin/env bash
# One device call: install the carried wheels, show the environment, run the GPU tests,
# `kda compare`, the variant experiments and `kda bench`. Logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# .whl carries fla-core 0.6.0 (the comparison) and pytest-xdist + execnet (tests in parallel:
# Triton compiles on the CPU, 16 cores there).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/fla_core*.whl .whl/pytest_xdist*.whl .whl/execnet*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -m kda info
step=${1:-all}
# steps: all, or one of cuda / bench / tests / compare / variants; several: "cuda bench".
# cuda runs first: it installs the package with its kernels and the later steps use that install.
if [[ $step == all || $step == *cuda* ]]; then
  # The CUDA path from a clean copy: `pip install .` builds the fatbins with nvcc (no network:
  # build requirements come from .whl, CUTLASS headers from the nvidia-cutlass wheel), then
  # the CUDA tests, compute-sanitizer on a small case, and `kda info` from the install.
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/scikit_build_core*.whl .whl/pathspec*.whl .whl/packaging*.whl .whl/nvidia_cutlass*.whl || exit 1
  rm -rf /tmp/kda-install build
  timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/kda-install . \
    > "$OUT/pip-install.log" 2>&1; tail -3 "$OUT/pip-install.log"
  ls /tmp/kda-install/kda/cuda/*.fatbin
  export PYTHONPATH=/tmp/kda-install:/tmp/site KDA_CUDA=1
  python3 -m kda info
  KDA_TRITON_AUTOTUNE=0 timeout ${CUDA_TEST_TIMEOUT:-240} python3 -m pytest -q -n ${WORKERS:-8} tests/test_cuda.py \
    -p no:cacheprovider > "$OUT/pytest-cuda.log" 2>&1; tail -15 "$OUT/pytest-cuda.log"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/cuda_smoke.py \
      > "$OUT/sanitizer-$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $?"; tail -3 "$OUT/sanitizer-$tool.log"
  done
fi
if [[ $step == all || $step == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 -m kda bench --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -30 "$OUT/bench.log"
fi
if [[ $step == all || $step == *tests* ]]; then
  KDA_TRITON_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n ${WORKERS:-8} ${TESTS:-tests} -p no:cacheprovider --durations=15 > "$OUT/pytest-gpu.log" 2>&1
  grep -E "passed|failed|kda o|Error|assert" "$OUT/pytest-gpu.log" | head -20
fi
if [[ $step == all || $step == *compare* ]]; then
  timeout 120 python3 -m kda compare > "$OUT/compare.log" 2>&1; tail -5 "$OUT/compare.log"
fi
if [[ $step == all || $step == *variants* ]]; then
  timeout 200 python3 benchmarks/variants.py > "$OUT/variants.log" 2>&1; cat "$OUT/variants.log"
fi
