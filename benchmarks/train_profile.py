"""The training step's Triton kernels on one case, kda alone: per-kernel GPU time, each
autotuned kernel's chosen config, and the registers and spills ptxas gave every compiled
variant (Triton's CompiledKernel.n_regs / n_spills, on the device's own Triton).
Usage: train_profile.py [CASE_INDEX] [ncu] [slice=N] [impl=NAME] [chain]; with ``ncu`` it only runs
three steps after a warm-up (for ``ncu --launch-skip``); ``slice=N`` sets chunk_grad.INPUT_GRAD_SLICE
(K columns per slice of the input-gradient kernel) first, to compare widths in one process;
``impl`` picks the contender (kda-triton, the default, or kda-cuda); ``chain`` (with kda-cuda) times
the step with ``kda.cuda.BACKWARD_CHAIN`` off and on, alternately, in this process; ``chainwidth``
(with kda-cuda) with the CUDA chain at each CTA width; ``products`` (with kda-cuda) with
``kda.cuda.STATE_PRODUCTS`` off and on."""

import sys

import torch

from kda import bench
from kda.triton import chunk_grad, prepare, recurrence, state_grad

for arg in sys.argv[2:]:
    if arg.startswith("slice="):
        chunk_grad.INPUT_GRAD_SLICE = int(arg.partition("=")[2])
        print("INPUT_GRAD_SLICE", chunk_grad.INPUT_GRAD_SLICE)
case = bench.TRAIN_CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
tensors, kw = bench.make_inputs(case)
impl = next((a.partition("=")[2] for a in sys.argv[2:] if a.startswith("impl=")), "kda-triton")
call = bench.train_contenders()[impl]
leaves, kw_i, grad_leaves, grads_out = bench.train_inputs(tensors, kw)


def step():
    for x in grad_leaves:
        x.grad = None
    bench.fwd_bwd(call, leaves, kw_i, grads_out)


step()
torch.cuda.synchronize()
if "ncu" in sys.argv[2:]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    sys.exit(0)


def alternate(module, name: str, values: tuple) -> None:
    """The step timed with ``module.name`` set to each of ``values`` in turn, two rounds, then
    restored."""
    import triton.testing

    kept = getattr(module, name)
    for round_ in range(2):
        for value in values:
            setattr(module, name, value)
            step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=25, rep=200)
            split = {k: round(v, 4) for k, v in bench.kernel_times(step, iters=10).items()}
            print(f"round {round_} {name} = {value}: step {ms:.3f} ms", split)
    setattr(module, name, kept)


if "chain" in sys.argv[2:]:  # the CUDA reverse chain (KDA_CUDA_BACKWARD_CHAIN) against the Triton stages
    import kda.cuda

    alternate(kda.cuda, "BACKWARD_CHAIN", (False, True))
if "products" in sys.argv[2:]:  # the CUDA state products (KDA_CUDA_STATE_PRODUCTS) against the Triton kernels
    import kda.cuda

    alternate(kda.cuda, "STATE_PRODUCTS", (False, True))
if "chainwidth" in sys.argv[2:]:  # the CUDA chain's CTA width (consumer warps, abi.CHAIN_WIDTHS)
    from kda import abi
    from kda.cuda import training

    alternate(training, "CHAIN_WARPS", abi.CHAIN_WIDTHS)
print(case["name"], impl, {k: round(v, 4) for k, v in bench.kernel_times(step, iters=10).items()})
for module in (prepare, recurrence, state_grad, chunk_grad):
    for name in dir(module):
        kernel = getattr(module, name)
        fn = getattr(kernel, "fn", None)
        if not name.endswith("_kernel") or fn is None:
            continue
        best = getattr(kernel, "best_config", None)
        print(name, "best:", best)
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                print(
                    f"   warps {meta.num_warps} stages {meta.num_stages} regs {compiled.n_regs} "
                    f"spills {compiled.n_spills} shared {meta.shared}"
                )
