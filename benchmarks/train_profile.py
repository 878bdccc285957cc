"""The training step's Triton kernels on one case, kda alone: per-kernel GPU time, each
autotuned kernel's chosen config, and the registers and spills ptxas gave every compiled
variant (Triton's CompiledKernel.n_regs / n_spills, on the device's own Triton).
Usage: train_profile.py [CASE_INDEX] [ncu] [slice=N]; with ``ncu`` it only runs three steps after a
warm-up (for ``ncu --launch-skip``); ``slice=N`` sets chunk_grad.INPUT_GRAD_SLICE (K columns per
slice of the input-gradient kernel) first, to compare widths in one process."""

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
call = bench.train_contenders()["kda-triton"]
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
print(case["name"], {k: round(v, 4) for k, v in bench.kernel_times(step, iters=10).items()})
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
