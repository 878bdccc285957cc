"""One bench case, kda-cuda beside fla in the same process (``bench.time_calls``), without
`kda bench`'s accuracy, host and layout sections: for a device call too short for the whole
bench. Usage: one_case.py CASE_INDEX; writes $OUT/one_case.json."""

import json
import os
import sys

import torch

from kda import bench
from kda.clocks import ClockSampler

case = bench.ANCHOR_CASES[int(sys.argv[1])]
calls = {name: call for name, call in bench.contenders().items() if name in ("kda-cuda", "fla")}
tensors, kw = bench.make_inputs(case)
row = {"case": case["name"], "gpu": torch.cuda.get_device_name(), "versions": bench.versions()}
with ClockSampler(torch.cuda.current_device()) as clocks:
    timing = bench.time_calls(calls, tensors, kw, clocks=clocks)
row["ms"], row["first_call_s"], row["pass_ms"], row["pass_clocks"] = timing
row["ratio"] = row["ms"]["kda-cuda"] / row["ms"]["fla"]
print(json.dumps(row), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "one_case.json"), "w") as f:
    json.dump(row, f, indent=1)
