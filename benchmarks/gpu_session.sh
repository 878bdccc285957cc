#!/usr/bin/env bash
# One device call: install the carried wheels, show the environment, run the GPU tests,
# `kda compare`, the variant experiments and `kda bench`. Logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla_core*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -m kda info
step=${1:-all}
if [[ $step == all || $step == tests ]]; then
  KDA_TRITON_AUTOTUNE=0 timeout 300 python3 -m pytest -q -x tests -p no:cacheprovider -s 2>&1 | tee "$OUT/pytest-gpu.log" | grep -E "passed|failed|error|kda o|Error|assert" | head -40
fi
if [[ $step == all || $step == compare ]]; then
  timeout 120 python3 -m kda compare 2>&1 | tee "$OUT/compare.log"
fi
if [[ $step == all || $step == variants ]]; then
  timeout 200 python3 benchmarks/variants.py 2>&1 | tee "$OUT/variants.log"
fi
if [[ $step == all || $step == bench ]]; then
  timeout 300 python3 -m kda bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
