"""The bf16 pool's decode against the plain call (bf16 write-back) by slot order (2026-12-07): the
bench's pool maps sequence n to slot N - 1 - n (bench_decode.kw_indices), so a pool's CTAs walk the
state memory downwards where a plain call's walk it upwards; the pool trails the plain call by 3.6
us at N=256 on the H200 (run 192), 3 us of it outside its CTAs' span (run 63). This times the CUDA
kernel's graph replay per order in rounds, one process: plain, pool reversed (the bench's), pool
ascending (slot n), pool random, pool ascending with N spare slots between (a pool twice N); then, by
the same orders, torch's gather of the slots into a buffer (``index_select``) and its scatter back
(``index_copy_``): is an order's cost the memory system's? (In run 210 slot_order_copy.py, 5c25335,
timed these beside the kernel; folded in here on 2026-12-07.)
``python benchmarks/pool_order.py [N [rounds]]``; one JSON line."""

import json
import sys

import torch

from kda.bench_decode import DECODE_HEADS, SLOT_ORDERS, D, decode_problem, graph_ms, kw_indices, state_bytes
from kda.cuda.decode import decode
from kda.validation import check_pool

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def problem(order: str):
    if order != "spread":
        return decode_problem(N, torch.bfloat16, "plain" if order == "plain" else f"pool_{order}")
    # (slot 2n of a pool of 2N: the bench has no such order)
    p = decode_problem(N, torch.bfloat16, "pool_ascending")
    return check_pool(p, torch.cat([p.pool, p.pool]).contiguous(), 2 * p.state_indices, None)


calls = {}
for order in ("plain", *SLOT_ORDERS, "spread"):
    p = problem(order)
    calls[order] = lambda p=p: decode(p, 128)
pool = torch.randn(N, DECODE_HEADS, D, D, device="cuda").to(torch.bfloat16)  # the copies' own pool and buffer
buf = torch.empty_like(pool)
for order in SLOT_ORDERS:
    idx = kw_indices(N, order).long()
    calls[f"gather_{order}"] = lambda idx=idx: torch.index_select(pool, 0, idx, out=buf)
    calls[f"scatter_{order}"] = lambda idx=idx: pool.index_copy_(0, idx, buf)
times = {name: [] for name in calls}
for _ in range(ROUNDS):
    for name, fn in calls.items():
        times[name].append(graph_ms(fn))
gb = state_bytes(N, torch.bfloat16) / 1e9
out = {
    "N": N,
    "gpu": torch.cuda.get_device_name(),
    "state_GB": gb,
    "ms": times,
    "median_ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
}
print(json.dumps(out))
