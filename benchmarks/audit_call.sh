#!/usr/bin/env bash
# One device call (2026-12-06): the GPU tests a review of the tests changed (vacuous checks made able
# to fail), and two mutants that the changed checks must now catch:
#   - the Triton decode's grid clamped to 65,535 programs: test_gpu_decode_of_more_than_65535_sequence_heads
#     must fail (at 2048 sequences one pair past the limit left unwritten passed its 5e-3 bar);
#   - KDA_CUDA_KERNELS_DIR naming fatbins that do not load: test_gpu_built_kernels_load_on_hopper must fail
#     (cuda_ready would have turned every CUDA test into a skip).
# Sources are mutated in place and restored on exit. Carries .whl and .kernels.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/site_wheels.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0 KDA_CUDA_KERNELS_DIR=$PWD/.kernels
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tests=(
  tests/test_decode.py::test_gpu_decode_of_more_than_65535_sequence_heads
  tests/test_cuda.py::test_gpu_built_kernels_load_on_hopper
  "tests/test_cuda.py::test_gpu_cuda_time_blocks_equal_the_uncut_call_bit_for_bit"
  tests/test_cuda_training.py::test_gpu_cuda_checkpoints_every_width_layout_and_state
  tests/test_cuda_training.py::test_gpu_cuda_state_products_against_triton
  tests/test_backward.py::test_gpu_cuda_training_forward_writes_the_checkpoints_triton_does
  tests/test_pools.py tests/test_cuda_decode.py
)
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfEs -n ${WORKERS:-12} -p no:cacheprovider "${tests[@]}" \
  > "$OUT/pytest-audit.log" 2>&1
grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest-audit.log" | tail -15
target=src/kda/triton/decode.py
source benchmarks/mutation.sh
keep_original "$target"
sed -i 's/decode_kernel\[(cdiv(p.V, BV) \* p.N \* p.HV,)\]/decode_kernel[(min(cdiv(p.V, BV) * p.N * p.HV, 65535),)]/' "$target"
grep -c "65535),)]" "$target" | sed 's/^/mutant grid lines: /'
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:xdist "${tests[0]}" 2>&1 | grep -E "^E |passed|failed" | head -4
restore_original
mkdir -p /tmp/bad-kernels
for f in prepare recurrence decode; do head -c 4096 /dev/urandom > /tmp/bad-kernels/$f.fatbin; done
KDA_CUDA_KERNELS_DIR=/tmp/bad-kernels timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:xdist "${tests[1]}" 2>&1 \
  | grep -E "^E |passed|failed" | head -4
