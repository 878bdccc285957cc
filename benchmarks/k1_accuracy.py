"""A K1 build's accuracy against float64 (2026-12-07: `.kernels-all3`'s tf32 A and w before it can
be the default; issue 13's bar: no worse than o 2.9e-3, state 2.4e-3). One process a build
(``KDA_CUDA_KERNELS_DIR``): kda-cuda and fla on the anchors' accuracy cases (``bench.accuracy_rows``'
lengths, H8) over several input seeds, on H96 and on the precomputed (far) gate, then relative RMS of
o and the final state. ``python benchmarks/k1_accuracy.py [seeds]``; a JSON line a row, the summary, then one JSON
line of it. Run 214 (H100, 2026-12-07): `.kernels` with K1_FLA=0 and three seeds ran to its end in
under 40 s; the tf32 build beside fla in the same call gave one row before the call ended (fla's
first calls are slow: give it its own call)."""

import json
import os
import sys

import torch

import kda
from kda.bench import contenders, make_inputs, reference64
from kda.reference import relative_rms

SEEDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
# K1_FLA=0: kda-cuda alone (fla's rows do not depend on the build: one process a pair of builds needs them once)
wanted = ("kda-cuda", "fla") if os.environ.get("K1_FLA", "1") != "0" else ("kda-cuda",)
calls = {name: call for name, call in contenders().items() if name in wanted}
assert "kda-cuda" in calls, "the CUDA backend is not available here: no build to check"
rows = []
for case in ({"H": 8}, {"H": 96}, {"H": 8, "gate": "precomputed"}):
    for lens in ([1024], [512, 300, 777]):
        for seed in range(1, SEEDS + 1):
            tensors, kw = make_inputs({"seq_lens": lens, **case}, seed=seed)
            o_ref, h_ref = reference64(tensors, kw)
            for name, call in calls.items():
                with kda.record_dispatch() as events:
                    o, h = call(tensors, kw)
                ran = [e for e in events if ":" in e][:3]
                rows.append({"case": {"lens": lens, **case}, "seed": seed, "impl": name, "o": relative_rms(o, o_ref),
                             "final_state": relative_rms(h, h_ref), "ran": ran})  # fmt: skip
                # (each row as it lands: run 212's two processes, cut at 95 s, left empty logs)
                print(json.dumps(rows[-1]), flush=True)
summary = {}
for r in rows:
    key = f"{r['impl']} {r['case']}"
    s = summary.setdefault(key, {"o": [], "final_state": []})
    s["o"].append(r["o"])
    s["final_state"].append(r["final_state"])
for key, s in summary.items():
    o, st = s["o"], s["final_state"]
    print(f"{key}: o mean {sum(o) / len(o):.4e} max {max(o):.4e}; state mean {sum(st) / len(st):.4e} max {max(st):.4e}")
print(json.dumps({"gpu": torch.cuda.get_device_name(), "kernels": os.environ.get("KDA_CUDA_KERNELS_DIR"),
                  "summary": summary}))  # fmt: skip
