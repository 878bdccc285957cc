"""The CUDA decode kernel of one build (``KDA_CUDA_KERNELS_DIR``), timed and checked, for an
A/B of decode.cu variants in alternating processes (benchmarks/gpu_session.sh step
``decodeab``): ``python benchmarks/decode_ab.py LABEL [N ...]``.

Per state dtype, mode (plain call, pool) and CTA width: the graph-replay time on the inputs
of ``kda bench --decode`` (kda.bench_decode.decode_inputs), and the output and new state
against the Triton decode kernel on the same inputs (relative RMS), so that a variant that
is fast because it is wrong shows. One JSON line per process."""

import json
import os
import sys

import torch
from ab_rows import ab_rows

from kda.bench_decode import decode_problem, graph_ms
from kda.cuda.decode import decode
from kda.reference import relative_rms
from kda.triton.decode import decode as triton_decode


def summary(path: str) -> None:
    rows, labels = ab_rows(path)
    print("graph ms per build (round 1 / round 2):", " | ".join(labels))
    for key in rows[0]["ms"] if rows else []:
        cells = [" / ".join(f"{r['ms'][key]:.4f}" for r in rows if r["label"] == label) for label in labels]
        print(key, " | ".join(cells))
    for r in rows:
        print(r["label"], "err vs triton (o, state):", {k: tuple(f"{x:.1e}" for x in v) for k, v in r["err"].items()})


if sys.argv[1] == "--summary":
    summary(sys.argv[2])
    sys.exit(0)
label = sys.argv[1]
sizes = [int(n) for n in sys.argv[2:]] or [32, 256, 1024]
WIDTHS = {torch.float32: (32, 64), torch.bfloat16: (64, 128)}
if os.environ.get("DECODE_AB_WIDTHS"):  # e.g. "bfloat16:128 float32:64": only these
    WIDTHS = {}
    for item in os.environ["DECODE_AB_WIDTHS"].split():
        dtype, columns = item.split(":")
        WIDTHS[getattr(torch, dtype)] = WIDTHS.get(getattr(torch, dtype), ()) + (int(columns),)


out = {"label": label, "kernels": os.environ.get("KDA_CUDA_KERNELS_DIR"), "ms": {}, "err": {}}
for state_dtype in WIDTHS:
    # (plain_f32: a bf16 state written back in float32, the _to_f32 entries, 2026-12-07)
    for mode in ("plain", "pool") if state_dtype == torch.float32 else ("plain", "plain_f32", "pool"):
        for columns in WIDTHS[state_dtype]:
            name = f"{str(state_dtype).removeprefix('torch.')}-{mode}-c{columns}"
            # accuracy against Triton on the smallest size; the pool's own state is the output
            p_cuda, p_ref = decode_problem(sizes[0], state_dtype, mode), decode_problem(sizes[0], state_dtype, mode)
            o, ht = decode(p_cuda, columns)
            o_ref, ht_ref = triton_decode(p_ref)
            if p_cuda.pool is not None:  # (any pool mode, bench_decode.slot_order)
                ht, ht_ref = p_cuda.pool, p_ref.pool
            out["err"][name] = (relative_rms(o, o_ref), relative_rms(ht, ht_ref))
            for N in sizes:
                p = decode_problem(N, state_dtype, mode)
                out["ms"][f"{name}-N{N}"] = graph_ms(lambda p=p, c=columns: decode(p, c))
print(json.dumps(out))
