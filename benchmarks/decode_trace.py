"""Where a decode CTA's time goes (a build with -DKDA_DECODE_TRACE=1, ``KDA_CUDA_KERNELS_DIR``):
each CTA writes, over its output row, its start and end (%globaltimer, ns), the clock64 cycles
from its start to four points (staging issued, slice landed, pass 1 done, stores issued) and its
SM. ``python benchmarks/decode_trace.py N [columns [state dtype]]``: per mode (``MODES``, default plain call and
pool) the medians, the SM clock, and how many CTAs were live over the kernel's span (its ramp and tail). Then, per mode,
``GRAPH_LAUNCHES`` launches captured in one graph and replayed: each launch's span and the gap from its
last CTA's end to the next launch's first CTA's start, beside the replay's time a launch (run 63 had the
pool's graph replay 3 us a call longer than its CTAs' span, where the plain call's was not; 2026-12-07)."""

import json
import os
import sys

import torch

from kda.bench_decode import decode_problem, graph_ms
from kda.cuda.decode import decode

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
columns = int(sys.argv[2]) if len(sys.argv) > 2 else 128
dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.bfloat16
GRAPH_LAUNCHES = int(os.environ.get("GRAPH_LAUNCHES", "4"))
# decode_problem's modes to trace (pool_random: the bench's random slots, 2026-12-07)
MODES = os.environ.get("MODES", "plain pool").split()


def q(x, f):
    return float(torch.quantile(x.double(), f))


def trace_table(o):
    """Every CTA's trace of the launch that wrote ``o``: start ns, end ns, then the four cycle counts."""
    return o.view(torch.int64).reshape(-1, o.shape[-1] // 4)[:, :8].cpu()


for mode in MODES:
    p = decode_problem(N, dtype, mode)
    ms = graph_ms(lambda: decode(p, columns))
    for _ in range(5):  # back-to-back launches, the last one read
        o, _ = decode(p, columns)
    torch.cuda.synchronize()
    tr = trace_table(o)
    start, end = tr[:, 0], tr[:, 1]
    t0 = start.min()
    life_ns = (end - start).double()
    cyc = tr[:, 2:6].double()
    ghz = float((cyc[:, 3] / life_ns.clamp(min=1)).median())
    span = float(end.max() - t0)
    edges = torch.linspace(0, span, 101, dtype=torch.float64)
    live = [int(((start - t0 <= e) & (end - t0 > e)).sum()) for e in edges[:-1]]
    out = {
        "mode": mode,
        "N": N,
        "columns": columns,
        "graph_ms": ms,
        "span_us": span / 1e3,
        "sm_ghz": ghz,
        "life_us_median": q(life_ns, 0.5) / 1e3,
        "life_us_p10_p90": (q(life_ns, 0.1) / 1e3, q(life_ns, 0.9) / 1e3),
        "cycles_median_issued_landed_pass1_end": [q(cyc[:, i], 0.5) for i in range(4)],
        "first_start_to_last_start_us": float(start.max() - t0) / 1e3,
        "live_ctas_per_1pct_of_span": live,
    }
    print(json.dumps(out), flush=True)


for mode in MODES:
    p = decode_problem(N, dtype, mode)
    outs = []

    def launches():  # graph_ms captures its last call: these outputs hold the replays' traces
        outs[:] = [decode(p, columns)[0] for _ in range(GRAPH_LAUNCHES)]

    ms = graph_ms(launches)
    torch.cuda.synchronize()
    rows = [(tr[:, 0], tr[:, 1]) for tr in map(trace_table, outs)]
    spans = [float(end.max() - start.min()) / 1e3 for start, end in rows]
    gaps = [float(rows[i + 1][0].min() - rows[i][1].max()) / 1e3 for i in range(len(rows) - 1)]
    print(
        json.dumps(
            {
                "mode": mode,
                "N": N,
                "columns": columns,
                "graph_launches": GRAPH_LAUNCHES,
                "replay_us_per_launch": ms * 1e3 / GRAPH_LAUNCHES,
                "span_us": spans,
                "gap_us_last_end_to_next_first_start": gaps,
                "first_start_to_last_start_us": [float(start.max() - start.min()) / 1e3 for start, _ in rows],
                "last_start_to_last_end_us": [float(end.max() - start.max()) / 1e3 for start, end in rows],
            }
        ),
        flush=True,
    )
