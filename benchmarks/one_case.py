"""One bench case, kda-cuda beside fla in the same process (do_bench median), printed as it
goes: for a device call too short for the whole `kda bench`. Usage: one_case.py CASE_INDEX"""

import json
import os
import sys
import time

import torch
import triton.testing

from kda import bench

case = bench.ANCHOR_CASES[int(sys.argv[1])]
calls = {name: call for name, call in bench.contenders().items() if name in ("kda-cuda", "fla")}
tensors, kw = bench.make_inputs(case)
row = {"case": case["name"], "gpu": torch.cuda.get_device_name(), "versions": bench.versions(), "ms": {}}
for name, call in calls.items():
    start = time.perf_counter()
    call(tensors, kw)
    torch.cuda.synchronize()
    print(name, "first call s", round(time.perf_counter() - start, 1), flush=True)
    row["ms"][name] = triton.testing.do_bench(lambda: call(tensors, kw), warmup=25, rep=100, return_mode="median")
    print(name, "ms", round(row["ms"][name], 3), flush=True)
row["ratio"] = row["ms"]["kda-cuda"] / row["ms"]["fla"]
print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "one_case.json"), "w") as f:
    json.dump(row, f, indent=1)
