"""The bf16 pool's decode against the plain call (bf16 write-back) by slot order (2026-12-07): the
bench's pool maps sequence n to slot N - 1 - n (bench_decode.kw_indices), so a pool's CTAs walk the
state memory downwards where a plain call's walk it upwards; the pool trails the plain call by 3.6
us at N=256 on the H200 (run 192), 3 us of it outside its CTAs' span (run 63). This times the CUDA
kernel's graph replay per order in rounds, one process: plain, pool reversed (the bench's), pool
ascending (slot n), pool random, pool ascending with N spare slots between (a pool twice N).
``python benchmarks/pool_order.py [N [rounds]]``; one JSON line."""

import json
import sys

import torch

from kda.bench_decode import SLOT_ORDERS, decode_problem, graph_ms, state_bytes
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


orders = ("plain", *SLOT_ORDERS, "spread")
problems = {name: problem(name) for name in orders}
times = {name: [] for name in orders}
for _ in range(ROUNDS):
    for name in orders:
        times[name].append(graph_ms(lambda p=problems[name]: decode(p, 128)))
gb = state_bytes(N, torch.bfloat16) / 1e9
out = {
    "N": N,
    "gpu": torch.cuda.get_device_name(),
    "state_GB": gb,
    "ms": times,
    "median_ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
}
print(json.dumps(out))
