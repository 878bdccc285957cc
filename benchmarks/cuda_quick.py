"""Quick look at the CUDA path (no autotuning, so it fits in one device call beside the
tests): per anchor case, median ms of kda-cuda and each K1/K2 kernel's share, plus the
anchors' accuracy rows. Not a reported benchmark: `kda bench` (with fla in the same
process) is the one that counts."""

import json
import os
import sys

import triton.testing

import kda
from kda import bench

calls = {"kda-cuda": lambda t, kw: kda.chunk_kda(*t, backend="cuda", **kw)}
report = {"accuracy": [] if os.environ.get("QUICK_NO_ACCURACY") else bench.accuracy_rows(calls), "cases": []}
for row in report["accuracy"]:
    print(row, flush=True)
for case in bench.ANCHOR_CASES:
    tensors, kw = bench.make_inputs(case)
    ms = triton.testing.do_bench(lambda: calls["kda-cuda"](tensors, kw), warmup=25, rep=100, return_mode="median")
    split = bench.kernel_split(calls, case)["kda-cuda"]
    report["cases"].append({"case": case["name"], "ms": ms, "split": split})
    print(case["name"], round(ms, 3), {k: round(v, 3) for k, v in split.items()}, flush=True)
if not os.environ.get("QUICK_NO_ACCURACY"):
    report["host"] = bench.host_overhead(calls)
    print(report["host"])
out = os.environ.get("OUT", "/tmp/out")
with open(f"{out}/cuda_quick{os.environ.get('KDA_CUDA_WARPS', '')}.json", "w") as f:
    json.dump(report, f, indent=1)
sys.exit(0)
