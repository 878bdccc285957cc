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

from kda.api import checked_problem
from kda.bench_decode import decode_inputs, graph_ms, state_bytes
from kda.cuda.decode import decode
from kda.validation import check_pool

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def problem(order: str):
    import kda

    t, kw = decode_inputs(N, state_dtype=torch.bfloat16)
    if order == "plain":
        return checked_problem(kda.fused_recurrent_kda, *t, **kw, output_final_state=True,
                               final_state_dtype=torch.bfloat16)  # fmt: skip
    pool = kw.pop("initial_state")
    slots = {
        "reversed": torch.arange(N - 1, -1, -1),
        "ascending": torch.arange(N),
        "random": torch.randperm(N, generator=torch.Generator().manual_seed(0)),
        "spread": 2 * torch.arange(N),
    }[order]
    if order == "spread":
        pool = torch.cat([pool, pool]).contiguous()
    return check_pool(checked_problem(kda.fused_recurrent_kda, *t, **kw), pool, slots.to("cuda", torch.int32), None)


orders = ("plain", "reversed", "ascending", "random", "spread")
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
