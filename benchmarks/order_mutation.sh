#!/usr/bin/env bash
# The backward order test's GPU byte check seen failing (2026-12-06): on a copy of the tree whose
# backward keeps a view of the state gradients past their `del` (the weak references the test holds
# die, the storage does not), test_backward_frees_the_state_gradients_before_the_input_gradients must
# fail on cuda at the byte check; the tree itself must pass. Needs a GPU and the CUDA kernels
# (KDA_CUDA_KERNELS_DIR, as gpu_session.sh sets from .kernels); fla and pytest-xdist are not needed.
set -uo pipefail
mut=/tmp/order-mutation
rm -rf "$mut" && mkdir -p "$mut" && cp -r src tests pyproject.toml "$mut"/
python3 - "$mut/src/kda/triton/training.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
line = "        del dstates, products, ws\n"
assert text.count(line) == 1, "the mutation's anchor moved"
open(path, "w").write(text.replace(line, "        kept = dstates.view(-1)  # the mutation\n" + line))
PY
test=tests/test_backward.py::test_backward_frees_the_state_gradients_before_the_input_gradients
for tree in "$PWD" "$mut"; do  # (BACKEND=triton on a CPU: the mutant passes, only the byte check sees it)
  echo "== $tree"
  (cd "$tree" && PYTHONPATH=${SITE:-/tmp/site}:$tree/src timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:xdist \
    "$test[${BACKEND:-cuda}]" 2>&1 | grep -E "assert|Error|passed|failed" | head -8)
done
