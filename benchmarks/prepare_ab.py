"""The CUDA forward of one build (``KDA_CUDA_KERNELS_DIR``), timed per kernel, for an A/B of
prepare.cu (K1) variants in alternating processes (benchmarks/gpu_session.sh step
``prepareab``): ``python benchmarks/prepare_ab.py LABEL``.

Per anchor case (kda.bench.ANCHOR_CASES, their inputs), the first with a steeper lower bound,
lb = -8 (K1's far entry point), and the long cases that AB_LONG_CASES names: the call's median
ms, K1's and K2's, and a hash of the output and final state, so that two builds of the same
arithmetic show the same bits (and a variant that is fast because it is wrong shows). One JSON
line per process; ``--summary FILE`` prints those lines of a file as a table."""

import hashlib
import json
import os
import sys

import torch
import triton.testing
from ab_rows import ab_rows

import kda
from kda import bench, bench_long


def summary(path: str) -> None:
    rows, labels = ab_rows(path)
    print("ms per build (round 1 / round 2; call, K1, K2):", " | ".join(labels))
    for case in rows[0]["ms"] if rows else []:
        cells = []
        for label in labels:
            runs = [(r["ms"].get(case, float("nan")), r["split"].get(case, {})) for r in rows if r["label"] == label]
            cells.append(" / ".join(f"{ms:.3f} ({split.get('kda_prepare', 0):.3f}, "
                                    f"{split.get('kda_recurrence', 0):.3f})" for ms, split in runs))  # fmt: skip
        print(case, " | ".join(cells))
    for r in rows:
        print(r["label"], "hash:", r["hash"])


if sys.argv[1] == "--summary":
    summary(sys.argv[2])
    sys.exit(0)
label = sys.argv[1]
calls = {"kda-cuda": lambda t, kw: kda.chunk_kda(*t, backend="cuda", **kw)}
cases = [*bench.ANCHOR_CASES, dict(bench.ANCHOR_CASES[0], name="1x8192 H96 lb -8")]
# AB_LONG_CASES="0,1,3": kda.bench_long's cases too (issue 13's bars are on them), timed as the anchors
# (one the anchors already hold, 1x32768 H32, is not timed twice)
cases += [
    case
    for case in (bench_long.LONG_CASES[int(i)] for i in os.environ.get("AB_LONG_CASES", "").split(",") if i)
    if case["name"] not in {c["name"] for c in cases}
]
out = {"label": label, "kernels": os.environ.get("KDA_CUDA_KERNELS_DIR"), "ms": {}, "split": {}, "hash": {}}


def measure(case: dict) -> None:
    tensors, kw = bench.make_inputs(case)
    if case["name"].endswith("lb -8"):
        kw.update(lower_bound=-8.0, safe_gate=False)
    o, ht = calls["kda-cuda"](tensors, kw)
    # (a long case's output is up to 2^31 elements: every 4099th of it, taken on the device)
    sample = o.flatten()[:: 1 if o.numel() < 2**26 else 4099]
    digest = hashlib.sha1(sample.float().cpu().numpy().tobytes() + ht.float().cpu().numpy().tobytes()).hexdigest()[:16]
    out["hash"][case["name"]] = digest if bool(torch.isfinite(o).all() and torch.isfinite(ht).all()) else "non-finite"
    out["ms"][case["name"]] = triton.testing.do_bench(
        lambda t=tensors, k=kw: calls["kda-cuda"](t, k),
        warmup=25,
        rep=bench_long.REP_MS if case in bench_long.LONG_CASES else 100,
        return_mode="median",
    )
    out["split"][case["name"]] = bench.kernel_times(lambda t=tensors, k=kw: calls["kda-cuda"](t, k))


for case in cases:
    try:
        measure(case)
    except Exception as error:  # a failing build still reports the cases before it (a CUDA error is sticky)
        out["hash"][case["name"]] = f"{type(error).__name__}: {str(error)[:80]}"
        break
print(json.dumps(out))
