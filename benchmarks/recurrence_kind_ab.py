"""kda-cuda's forward as routed (the wgmma K2 where ``forward.recurrence_kind`` takes it) against
the same call on the mma.sync K2 (``KDA_CUDA_WARPS=mma``) and fla's ``chunk_kda``
(FLA_FLASH_KDA=0), all in one process on the same inputs (device runs):
``python benchmarks/recurrence_kind_ab.py [--cases 0,1,...] [--passes 3] [--no-fla] [--out FILE]``.

Per anchor case (kda.bench.ANCHOR_CASES): the K2 the rule took (the dispatch log), then
``--passes`` rounds of a do_bench median per contender, in turn, with the SM clock and the share
of nvidia-smi samples under the power cap over each pass (kda.clocks); the median of the passes,
each kda route's ratio to fla, and o and the final state of the two kda routes against each
other (relative RMS). One JSON line per case, then a Markdown table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton.testing

import kda
import kda.cuda
from kda import bench
from kda.clocks import ClockSampler
from kda.reference import relative_rms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(bench.ANCHOR_CASES))))
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--no-fla", action="store_true", help="kda's two routes alone (fla untuned here)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "recurrence-kind-ab.jsonl"))
    args = parser.parse_args()
    fla = None if args.no_fla else bench.contenders().get("fla")
    rows = []
    with ClockSampler(torch.cuda.current_device()) as sampler, open(args.out, "w") as out:
        bench.start_jsonl(out)
        for i in (int(c) for c in args.cases.split(",")):
            case = bench.ANCHOR_CASES[i]
            tensors, kw = bench.make_inputs(case)

            def kda_call(route, tensors=tensors, kw=kw):
                kda.cuda.WARPS_OVERRIDE = route
                return kda.chunk_kda(*tensors, backend="cuda", **kw)

            calls = {"kda": lambda: kda_call(None), "kda mma": lambda: kda_call("mma")}
            if fla is not None:
                calls["fla"] = lambda tensors=tensors, kw=kw: fla(tensors, kw)
            with kda.record_dispatch() as events:
                o, ht = calls["kda"]()
            o_mma, ht_mma = calls["kda mma"]()
            for fn in calls.values():  # compiles and tunes outside the timings
                fn()
            torch.cuda.synchronize()
            row = {"case": case["name"], "route": [e for e in events if e.startswith("cuda:recurrence")],
                   "o_vs_mma": relative_rms(o.float(), o_mma.float()),
                   "state_vs_mma": relative_rms(ht.float(), ht_mma.float())}  # fmt: skip
            times, spans = {name: [] for name in calls}, {name: [] for name in calls}
            for _ in range(args.passes):
                for name, fn in calls.items():
                    t0 = time.time()
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
                    spans[name].append((t0, time.time()))
            kda.cuda.WARPS_OVERRIDE = None
            for name in calls:
                row[f"{name} ms"] = statistics.median(times[name])
                row[f"{name} passes"] = times[name]
                row[f"{name} clocks"] = sampler.windows(spans[name])
            if "fla" in calls:
                row["kda / fla"] = row["kda ms"] / row["fla ms"]
                row["kda mma / fla"] = row["kda mma ms"] / row["fla ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    print("\n| case | K2 as routed | kda ms | kda mma ms | fla ms | kda / fla | kda mma / fla | o vs mma |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {','.join(r['route'])} | {r['kda ms']:.4f} | {r['kda mma ms']:.4f} | "
              f"{r.get('fla ms', float('nan')):.4f} | {r.get('kda / fla', float('nan')):.3f} | "
              f"{r.get('kda mma / fla', float('nan')):.3f} | {r['o_vs_mma']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
