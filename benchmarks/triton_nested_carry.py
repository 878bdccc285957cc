"""Whether this Triton keeps a nested loop's bounds carried by the outer loop (sm_90 compile, no
GPU needed): the pattern of the persistent decode launch of commit 7f6cfd0, which Triton 3.6.0
miscompiled (TritonGPURemoveLayoutConversions dropped the carried bounds and the inner loop ran
from the values computed before the outer loop; benchmarks/NOTES.md, run 19). Prints, for the
carried form and for bounds recomputed in the loop, the inner loop's bounds in the TTGIR and
whether they come from the outer loop.

    python benchmarks/triton_nested_carry.py   # with the Triton to check on the PYTHONPATH"""

from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile


@triton.jit
def _span(n, T):
    return n * T, n * T + T


@triton.jit
def carried(x, T, ITEMS):
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    bos_next, eos_next = _span(pid, T)
    for it in tl.range(pid, ITEMS, step):
        bos, eos = bos_next, eos_next
        bos_next, eos_next = _span(it + step, T)
        for t in tl.range(bos, eos):
            tl.store(x + t, it)


@triton.jit
def recomputed(x, T, ITEMS):
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    for it in tl.range(pid, ITEMS, step):
        bos, eos = _span(it, T)
        for t in tl.range(bos, eos):
            tl.store(x + t, it)


def inner_bounds(kernel) -> tuple[str, bool]:
    sig = {"x": "*i64", "T": "i32", "ITEMS": "i32"}
    ttgir = compile(ASTSource(fn=kernel, signature=sig, constexprs={}), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 1}).asm["ttgir"]  # fmt: skip
    outer = re.search(r"scf\.for (%\S+) = .*?iter_args\((.*?)\)", ttgir)
    inner = re.findall(r"scf\.for %\S+ = (%\S+) to (%\S+) step", ttgir)[-1]
    from_outer = {outer.group(1)} if outer else set()
    if outer:
        from_outer |= {a.split(" = ")[0].strip() for a in outer.group(2).split(",")}
    # the recomputed form derives its bounds from the induction variable inside the body
    body = ttgir.split("scf.for", 1)[1]
    defined_in_body = set(re.findall(r"(%[\w.]+)(?::\d+)? = ", body))
    return f"{inner[0]} to {inner[1]}", all(b in from_outer or b in defined_in_body for b in inner)


if __name__ == "__main__":
    print("triton", triton.__version__)
    for kernel in (carried, recomputed):
        bounds, ok = inner_bounds(kernel)
        print(f"{kernel.fn.__name__}: inner loop {bounds}: {'per item (right)' if ok else 'fixed (miscompiled)'}")
