"""Why the same kda-cuda call reads slower after other GPU work (run 98: 1x8192 H96 0.91 ms
as a fresh process's first case, 0.99-1.01 ms after fla's 73 s autotune): the GPU's clocks
(power, heat) or the caching allocator's state. One process, kda-cuda on one anchor case timed
in phases: fresh; after fla's first call and its timing; after ``torch.cuda.empty_cache()``;
straight after a bf16 matmul burn; after an idle pause. Beside each timing: the caching
allocator's counters (device allocations, retries, reserved bytes) and nvidia-smi's SM clock,
power, temperature and throttle reasons, sampled every 100 ms by a background nvidia-smi into
$OUT/slowdown-smi.csv (the phases' wall times are printed, so each timing can be matched to its
samples). Usage: slowdown.py [CASE_INDEX] [BURN_S]; writes $OUT/slowdown.json."""

import json
import os
import subprocess
import sys
import time

import torch
import triton.testing

from kda import bench

OUT = os.environ.get("OUT", "/tmp")
case = bench.ANCHOR_CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
burn_s = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
smi_log = open(os.path.join(OUT, "slowdown-smi.csv"), "w")  # noqa: SIM115 - open while nvidia-smi writes
smi = subprocess.Popen(
    ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "100"],
    stdout=smi_log,
    stderr=subprocess.STDOUT,
)
calls = {name: call for name, call in bench.contenders().items() if name in ("kda-cuda", "fla")}
tensors, kw = bench.make_inputs(case)
rows = []


def allocator() -> dict:
    s = torch.cuda.memory_stats()
    keep = ("num_device_alloc", "num_device_free", "num_alloc_retries", "segment.all.current")
    return {k: s.get(k) for k in keep} | {"reserved_gb": round(torch.cuda.memory_reserved() / 2**30, 2)}


def timed(phase: str, name: str = "kda-cuda", repeats: int = 3) -> None:
    for i in range(repeats):
        before, t0 = allocator(), time.time()
        ms = triton.testing.do_bench(lambda: calls[name](tensors, kw), warmup=25, rep=100, return_mode="median")
        row = {"phase": phase, "impl": name, "i": i, "ms": round(ms, 4), "wall": [round(t0, 2), round(time.time(), 2)]}
        row["allocator_before"], row["allocator_after"] = before, allocator()
        rows.append(row)
        print(json.dumps(row), flush=True)


calls["kda-cuda"](tensors, kw)
torch.cuda.synchronize()
timed("fresh")
t0 = time.time()
calls["fla"](tensors, kw)
torch.cuda.synchronize()
print(f"fla first call {time.time() - t0:.1f} s", flush=True)
timed("fla", "fla", 2)
timed("after-fla")
torch.cuda.empty_cache()
timed("after-empty-cache")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t0 = time.time()
while time.time() - t0 < burn_s:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
timed("after-burn")
time.sleep(20)
timed("after-idle-20s")
smi.terminate()
smi_log.close()
summary = {"case": case["name"], "gpu": torch.cuda.get_device_name(), "versions": bench.versions(), "rows": rows}
with open(os.path.join(OUT, "slowdown.json"), "w") as f:
    json.dump(summary, f)
