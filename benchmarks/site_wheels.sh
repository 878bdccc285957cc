# Sourced by the device scripts: the carried wheels the GPU tests need (fla-core 0.6.0 for the
# comparisons, pytest-xdist and execnet for parallel tests: Triton compiles on the CPU, 16 cores
# there) installed into /tmp/site; a failed install ends the calling script.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/fla_core*.whl .whl/pytest_xdist*.whl .whl/execnet*.whl || exit 1
