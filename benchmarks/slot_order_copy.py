"""Does a pure copy by slot index slow down with random slots, as kda's decode kernel does (1-2%,
run 209)? (2026-12-07) For a bf16 pool [N, 32, 128, 128], graph-replay medians, one process, by
slot order (bench_decode.SLOT_ORDERS): torch's gather of the N slots into a buffer
(``index_select``), its scatter back (``index_copy_``), and kda's decode kernel on the same
order. If the copies slow down too, the cost is the memory system's, not the kernel's.
``python benchmarks/slot_order_copy.py [N [rounds]]``; one JSON line."""

import json
import sys

import torch

from kda.bench_decode import SLOT_ORDERS, decode_problem, graph_ms, kw_indices
from kda.cuda.decode import decode

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3

pool = torch.randn(N, 32, 128, 128, device="cuda").to(torch.bfloat16)
buf = torch.empty_like(pool)
calls = {}
for order in SLOT_ORDERS:
    idx = kw_indices(N, order).long()
    p = decode_problem(N, torch.bfloat16, f"pool_{order}")
    calls[f"gather_{order}"] = lambda idx=idx: torch.index_select(pool, 0, idx, out=buf)
    calls[f"scatter_{order}"] = lambda idx=idx: pool.index_copy_(0, idx, buf)
    calls[f"decode_{order}"] = lambda p=p: decode(p, 128)
times = {name: [] for name in calls}
for _ in range(ROUNDS):
    for name, fn in calls.items():
        times[name].append(graph_ms(fn))
out = {
    "N": N,
    "gpu": torch.cuda.get_device_name(),
    "pool_GB": pool.numel() * pool.element_size() / 1e9,
    "ms": times,
    "median_ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
}
print(json.dumps(out))
