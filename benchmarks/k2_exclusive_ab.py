"""K1 beside a wgmma K2 that has its SMs to itself (device runs, issue 13):
``python benchmarks/k2_exclusive_ab.py [--cases 1x32768,1x131072] [--passes 2] [--out FILE]``.

Runs 86-90 put K1 of time block i + 1 beside K2 of block i and found K2's chains at about half
speed while K1 ran beside them (K1's CTAs shared K2's SMs). The one-CTA-an-SM wgmma K2 covers 64
V rows a CTA, so one long sequence of H = 32 heads is 64 CTAs: half the SMs. Launched with the
SM's whole shared memory (``pad``: the launch asks for the opt-in maximum, which the kernel does
not use), no K1 CTA fits beside a K2 CTA, so K1 gets the other SMs and K2 its own. This script
times, in one process on the same inputs, the call as routed, the mma.sync and wgmma K2 uncut
and in time blocks, the wgmma K2 in blocks with the padding, beside fla (``--configs``: a subset;
``--no-fla``); and checks that every wgmma configuration writes the same bits (blocks and padding
change where work runs, not what it computes). One JSON line per case, then a table.

Run 123 (2026-12-04, benchmarks/NOTES.md): the padding changed nothing, the wgmma K2 in blocks won,
and "routed" was then the mma.sync K2 in eight blocks; since 37ed6f3 the rule takes the wgmma K2
in blocks, so "routed" is that and "mma b8" the former route."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics

import torch
import triton.testing

import kda
import kda.cuda
from kda import bench
from kda.cuda import loader

CASES = {
    "1x32768": {"name": "1x32768 H32", "seq_lens": [32768], "H": 32},
    "1x131072": {"name": "1x131072 H32", "seq_lens": [131072], "H": 32},
    "1x32768-H24": {"name": "1x32768 H24", "seq_lens": [32768], "H": 24},
    "1x65536-H20": {"name": "1x65536 H20", "seq_lens": [65536], "H": 20},
}
# label -> (KDA_CUDA_WARPS, KDA_CUDA_BLOCKS, pad)
CONFIGS = {
    "routed": (None, None, False),
    "mma uncut": ("mma", "1", False),
    "mma b8": ("mma", "8", False),
    "wgmma1 uncut": ("wgmma1", "1", False),
    "wgmma1 b8": ("wgmma1", "8", False),
    "wgmma1 b8 pad": ("wgmma1", "8", True),
    "wgmma1 b4 pad": ("wgmma1", "4", True),
    "wgmma1 b16 pad": ("wgmma1", "16", True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="labels of CONFIGS, comma-separated")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "k2-exclusive-ab.jsonl"))
    args = parser.parse_args()
    name, own = loader.RECURRENCE_WGMMA_KERNELS[1]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # The kernel's static shared memory (its mbarriers) is 1 KB (ptxas -v, nvcc 13.0).
    pad = props.shared_memory_per_block_optin - 1024
    loader.SIZED_KERNELS = tuple((n, pad if n == name else s) for n, s in loader.SIZED_KERNELS)
    fla = None if args.no_fla else bench.contenders().get("fla")
    rows = []
    with open(args.out, "w") as out:
        bench.start_jsonl(out, pad_bytes=pad, own_bytes=own)
        for key in args.cases.split(","):
            case = CASES[key]
            tensors, kw = bench.make_inputs(case)

            def kda_call(config, tensors=tensors, kw=kw):
                warps, blocks, padded = config
                kda.cuda.WARPS_OVERRIDE, kda.cuda.BLOCKS_OVERRIDE = warps, blocks
                loader.RECURRENCE_WGMMA_KERNELS[1] = (name, pad if padded else own)
                try:
                    return kda.chunk_kda(*tensors, backend="cuda", **kw)
                finally:
                    kda.cuda.WARPS_OVERRIDE = kda.cuda.BLOCKS_OVERRIDE = None
                    loader.RECURRENCE_WGMMA_KERNELS[1] = (name, own)

            chosen = args.configs.split(",")
            calls = {label: (lambda c=config: kda_call(c)) for label, config in CONFIGS.items() if label in chosen}
            if fla is not None:
                calls["fla"] = lambda tensors=tensors, kw=kw: fla(tensors, kw)
            row = {"case": case["name"], "hash": {}, "events": {}, "ms": {}}
            for label, fn in calls.items():
                with kda.record_dispatch() as events:
                    o, ht = fn()
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
                bits = o.float().cpu().numpy().tobytes() + ht.float().cpu().numpy().tobytes()
                row["hash"][label] = hashlib.sha1(bits).hexdigest()[:16] if finite else "non-finite"
                row["events"][label] = sorted(set(events))
            passes = {label: [] for label in calls}
            for _ in range(args.passes):
                for label, fn in calls.items():
                    passes[label].append(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
            row["passes"] = passes
            row["ms"] = {label: statistics.median(v) for label, v in passes.items()}
            wgmma = {row["hash"][label] for label in calls if label.startswith("wgmma")}
            row["wgmma_bits_agree"] = len(wgmma) == 1
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            rows.append(row)
    for row in rows:
        fla_ms = row["ms"].get("fla")
        print(f"\n{row['case']} (wgmma configurations' bits agree: {row['wgmma_bits_agree']})")
        for label, ms in row["ms"].items():
            ratio = f"{ms / fla_ms:.3f}" if fla_ms else "-"
            print(f"| {label} | {ms:.3f} | {ratio} | {' '.join(f'{x:.3f}' for x in row['passes'][label])} |")


if __name__ == "__main__":
    main()
