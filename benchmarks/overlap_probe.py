"""K2 beside K1 (issue 13, item 4): for each case, the CUDA forward launched as before (K1, then
K2) and with K2 beside a persistent K1 (kda.cuda.forward.overlap_prepare_ctas) at several K1
grids and K2 widths, beside fla's chunk_kda in the same process on the same inputs.

Each overlapped configuration must reproduce the serial launch bit for bit (the arithmetic is
the same; only the schedule differs) on three calls, and its dispatch log must show the
launch beside K1; then do_bench medians. Usage: overlap_probe.py [CASE_INDEX ...] (indices of
kda.bench.ANCHOR_CASES, default 0-5, or EXTRA_CASES' keys). Writes $OUT/overlap-probe.json.
"""

import json
import os
import sys

import torch
import triton.testing

import kda
import kda.cuda as switches
from kda import bench
from kda.cuda import forward

# (label, KDA_CUDA_OVERLAP, K1 CTAs an SM, KDA_CUDA_WARPS)
CONFIGS = [
    ("serial", "0", None, None),
    ("beside, K1 1/SM", "1", "1", None),
    ("beside, K1 2/SM", "1", "2", None),
    ("beside, K1 3/SM", "1", "3", None),
    ("beside, K1 2/SM, K2 w4", "1", "2", "4"),
    ("beside, K1 3/SM, K2 w4", "1", "3", "4"),
    ("serial, K2 w4", "0", None, "4"),
]
# "L": one long sequence uncut (K1 and K2 alone); "S": the segment split as routed, whose two
# chunk passes are varlen calls over the segments.
EXTRA_CASES = {
    "L": ({"name": "1x131072 H8 (uncut)", "seq_lens": [131072], "H": 8}, "0"),
    "S": ({"name": "1x524288 H8 (split, auto)", "seq_lens": [524288], "H": 8}, ""),
}


def set_config(overlap, ctas, warps):
    switches.OVERLAP, switches.OVERLAP_CTAS, switches.WARPS_OVERRIDE = overlap, ctas, warps


def main() -> None:
    picks = sys.argv[1:] or ["0", "1", "2", "3", "4", "5"]
    cases = [EXTRA_CASES[pick] if pick in EXTRA_CASES else (bench.ANCHOR_CASES[int(pick)], "0") for pick in picks]
    fla = bench.contenders()["fla"]
    report = {"gpu": torch.cuda.get_device_name(), "versions": bench.versions(), "rows": []}
    for case, segment_tokens in cases:
        os.environ["KDA_SEGMENT_TOKENS"] = segment_tokens  # "0": uncut, "": the automatic split
        tensors, kw = bench.make_inputs(case)
        row = {"case": case["name"], "ms": {}, "bitwise": {}}

        def call():
            return kda.chunk_kda(*tensors, backend="cuda", **kw)

        fla(tensors, kw)
        row["ms"]["fla"] = triton.testing.do_bench(lambda: fla(tensors, kw), warmup=25, rep=200, return_mode="median")
        set_config("0", None, None)
        o_ref, ht_ref = call()
        for label, overlap, ctas, warps in CONFIGS:
            set_config(overlap, ctas, warps)
            same = True
            with kda.record_dispatch() as events:
                for _ in range(3):
                    o, ht = call()
                    same &= torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
            beside = "cuda:recurrence beside prepare" in events
            if beside != (overlap == "1"):
                raise AssertionError(f"{case['name']} {label}: dispatch log {events}")
            row["bitwise"][label] = bool(same)
            row["ms"][label] = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            print(f"{case['name']:24s} {label:26s} {row['ms'][label]:8.4f} ms "
                  f"({row['ms'][label] / row['ms']['fla']:.3f} of fla {row['ms']['fla']:.4f}) bitwise {same}",
                  flush=True)  # fmt: skip
        set_config(None, None, None)
        report["rows"].append(row)
        torch.cuda.empty_cache()
    print("K1 grid at 1/SM:", forward.sm_count(0), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "overlap-probe.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
