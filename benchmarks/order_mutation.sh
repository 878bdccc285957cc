#!/usr/bin/env bash
# The backward order test's GPU byte check seen failing (2026-12-06): with the backward keeping the
# state gradients' storage past their `del` in a tensor of its own (not a view: a view's base would
# keep the tensor the test's weak reference watches, and that check fails first, seen on the CPU),
# test_backward_frees_the_state_gradients_before_the_input_gradients must fail on cuda at the byte
# check; the tree itself must pass. On a CPU (BACKEND=triton) the mutant passes: no byte check there.
# The mutation is made in place and undone on exit (an editable install's import hook takes `kda` from
# the checkout whatever PYTHONPATH says, so a mutated copy elsewhere would not be what runs). Needs a
# GPU and the CUDA kernels (KDA_CUDA_KERNELS_DIR, as gpu_session.sh sets from .kernels).
set -uo pipefail
target=src/kda/triton/training.py
source benchmarks/mutation.sh
keep_original "$target"
export PYTHONPATH=${SITE:-/tmp/site}:$PWD/src
test=tests/test_backward.py::test_backward_frees_the_state_gradients_before_the_input_gradients
run() {
  python3 -c "import kda.triton.training as t; print('runs', t.__file__, \
'(mutant)' if 'the mutation' in open(t.__file__).read() else '(tree)')"
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -p no:xdist \
    "$test[${BACKEND:-cuda}]" 2>&1 | grep -E "^E |passed|failed|order test bytes" | head -8
}
run
python3 - "$target" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
line = "        del dstates, products, ws\n"
assert text.count(line) == 1, "the mutation's anchor moved"
kept = "        kept = torch.empty(0, dtype=dstates.dtype, device=dstates.device).set_(dstates.untyped_storage())"
open(path, "w").write(text.replace(line, kept + "  # the mutation\n" + line))
PY
run
