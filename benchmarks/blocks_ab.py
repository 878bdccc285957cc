"""A CUDA-path switch's values against each other in one process, beside fla on the same inputs
(device runs). By default K1 beside K2 in time blocks (``KDA_CUDA_BLOCKS``,
kda.cuda.forward.pipeline_blocks) against the uncut launch:

python benchmarks/blocks_ab.py [--cases NAMES] [--blocks 1,4,8,16,32,auto] [--widths auto,2] [--rounds N]
python benchmarks/blocks_ab.py --switch NAME --blocks V0,V1 [--graph]   # another switch, V0 the baseline

Per case (inputs as ``kda bench``), per K2 width (``KDA_CUDA_WARPS``; auto: the rule) and per
value of the switch (``--blocks``: its values, the first the baseline; auto: unset, the rule,
whose block count the dispatch log gives): the do_bench median (``--graph``: of a CUDA graph's
replay) and whether o and the final state equal the baseline's bit for bit; fla's median where
its autotune cache holds the head count (--fla-heads). One JSON line per case, then a table.
(Runs 93-95 compared experiments' switches, KDA_CUDA_PDL and KDA_CUDA_BLOCKS_ONE_K2, since removed.)"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton.testing

import kda
import kda.cuda
from kda import bench

CASES = {
    "1x32768-H32": {"seq_lens": [32768], "H": 32},
    "varlen6-H96": {"seq_lens": [1300, 547, 2048, 963, 271, 3063], "H": 96},
    "1024x8-H96": {"seq_lens": [1024] * 8, "H": 96},
    "1x2048-H32": {"seq_lens": [2048], "H": 32},
    "varlen16x128-H32": {"seq_lens": [128] * 16, "H": 32},
    "1x131072-H32": {"seq_lens": [131072], "H": 32},
    "1x8192-H64": {"seq_lens": [8192], "H": 64},
    "1x8192-H96": {"seq_lens": [8192], "H": 96},
    "1x65536-H16": {"seq_lens": [65536], "H": 16},
}


def switch(name: str, value: str | None) -> None:
    if value is None or value == "auto":
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    kda.cuda.read_switches()


def timed(fn, rep: int, graph: bool = False) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def measure(name: str, args, fla, fla_heads: set[int]) -> dict:
    case = dict(CASES[name], name=name)
    tensors, kw = bench.make_inputs(case)
    row = {"case": name, "ms": {}, "same": {}, "dispatch": {}}
    if fla is not None and case["H"] in fla_heads:
        fla(tensors, kw)
        row["fla"] = timed(lambda: fla(tensors, kw), args.rep)
    values = args.blocks.split(",")
    for width in args.widths.split(","):
        switch("KDA_CUDA_WARPS", width)
        switch(args.switch, values[0])
        o_base, ht_base = kda.chunk_kda(*tensors, backend="cuda", **kw)
        for round_, value in ((r, v) for r in range(1, args.rounds + 1) for v in values):
            switch(args.switch, value)
            label = f"w{width} b{value}" + (f" r{round_}" if args.rounds > 1 else "")
            with kda.record_dispatch() as events:
                o, ht = kda.chunk_kda(*tensors, backend="cuda", **kw)
            row["dispatch"][label] = next((e for e in events if e.startswith("cuda:blocks")), "uncut")
            row["same"][label] = bool(torch.equal(o, o_base) and torch.equal(ht, ht_base))
            row["ms"][label] = timed(lambda: kda.chunk_kda(*tensors, backend="cuda", **kw), args.rep, args.graph)
    switch("KDA_CUDA_WARPS", None)
    switch(args.switch, None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--switch", default="KDA_CUDA_BLOCKS", help="the environment switch whose values are compared")
    parser.add_argument("--blocks", default="1,4,8,16,32,auto", help="the switch's values, the first the baseline")
    parser.add_argument("--graph", action="store_true", help="time CUDA graph replays (do_bench_cudagraph)")
    parser.add_argument("--widths", default="auto")
    parser.add_argument("--fla-heads", default="32,64,96", help="head counts fla's autotune cache holds")
    parser.add_argument("--rep", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=1, help="times through the block counts (an ABAB order)")
    args = parser.parse_args()
    fla = bench.contenders().get("fla")
    fla_heads = {int(h) for h in args.fla_heads.split(",") if h}
    env = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), **bench.versions()}
    env["args"] = vars(args)
    print(json.dumps({"environment": env}), flush=True)
    rows = []
    for name in args.cases.split(","):
        rows.append(measure(name, args, fla, fla_heads))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    base = f"b{args.blocks.split(',')[0]}"
    print(f"| case | variant ({args.switch}) | dispatch | ms | / {base} | / fla | bits |")
    print("|---|---|---|---:|---:|---:|---|")
    for row in rows:
        for label, ms in row["ms"].items():
            width, _, *round_ = label.split(" ")
            baseline = row["ms"].get(" ".join([width, base, *round_]), float("nan"))
            fla_ratio = f"{ms / row['fla']:.3f}" if "fla" in row else "-"
            print(f"| {row['case']} | {label} | {row['dispatch'][label]} | {ms:.3f} | {ms / baseline:.3f} | "
                  f"{fla_ratio} | {'same' if row['same'][label] else 'DIFFERENT'} |")  # fmt: skip
        if "fla" in row:
            print(f"| {row['case']} | fla | | {row['fla']:.3f} | | 1.000 | |")


if __name__ == "__main__":
    main()
