"""Design experiments for the Triton forward (GPU): workspace dtype and state-dot precision.

Times kda.triton.chunk_forward variants on two anchor cases beside fla, and their accuracy
against fp64 on the anchors' accuracy case. Prints a table; notes go to benchmarks/NOTES.md.
"""

import torch
import triton.testing

import kda
from kda import bench
from kda.api import checked_problem
from kda.reference import relative_rms
from kda.triton import run_stages

VARIANTS = {
    "bf16 ws, tf32 state dots": dict(workspace_dtype=torch.bfloat16, mixed=False),
    "bf16 ws, bf16 state dots": dict(workspace_dtype=torch.bfloat16, mixed=True),
    "fp16 ws, tf32 state dots": dict(workspace_dtype=torch.float16, mixed=False),
    "fp32 ws, tf32 state dots": dict(workspace_dtype=torch.float32, mixed=False),
}


def outputs(p):
    return torch.empty_like(p.v), torch.empty(p.state_shape, device=p.q.device)


def main():
    calls = bench.contenders()
    fla = calls.get("fla")
    print("| variant | case | ms | / fla | o err | state err |")
    print("|---|---|---:|---:|---:|---:|")
    tensors, kw = bench.make_inputs({"seq_lens": [512, 300, 777], "H": 8}, seed=1)
    o_ref, h_ref = bench.reference64(tensors, kw)
    acc = {}
    for name, var in VARIANTS.items():
        p = checked_problem(kda.chunk_kda, *tensors, **kw)
        o, h = run_stages(p, *outputs(p), **var)
        acc[name] = (relative_rms(o, o_ref), relative_rms(h, h_ref))
    for case in (bench.ANCHOR_CASES[0], bench.ANCHOR_CASES[4]):
        tensors, kw = bench.make_inputs(case)
        fla_ms = (
            triton.testing.do_bench(lambda: fla(tensors, kw), warmup=25, rep=100, return_mode="median")
            if fla
            else float("nan")
        )
        for name, var in VARIANTS.items():
            p = checked_problem(kda.chunk_kda, *tensors, **kw)
            bufs = outputs(p)
            ms = triton.testing.do_bench(lambda: run_stages(p, *bufs, **var), warmup=25, rep=100, return_mode="median")
            print(
                f"| {name} | {case['name']} | {ms:.3f} | {ms / fla_ms:.3f} | {acc[name][0]:.2e} | {acc[name][1]:.2e} |",
                flush=True,
            )
        print(f"| fla | {case['name']} | {fla_ms:.3f} | 1 | | |")


if __name__ == "__main__":
    main()
