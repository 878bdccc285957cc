"""K1 as resident CTAs that walk the items (prepare.cu kda_prepare_items, KDA_CUDA_K1_ITEMS=1)
against K1 a CTA an item (kda_prepare_wgmma), for compute-sanitizer (memcheck, racecheck,
synccheck: the items kernel copies an item's inputs into shared tiles while the item before it
still runs): varlen with empty, one-token and partial chunks, three heads, both wgmma K2 widths,
grids of one, five and all resident CTAs; o and the final state must match bit for bit.
Exits non-zero on a difference. ``python benchmarks/items_smoke.py``"""

import sys

import torch

import kda
import kda.cuda
from kda.api import checked_problem
from kda.cuda import forward

sys.path.insert(0, "tests")
from helpers import make_case  # noqa: E402

failures = []
for ctas_an_sm, grid in ((1, 1), (2, 5), (1, None)):
    kda.cuda.WARPS_OVERRIDE = f"wgmma{ctas_an_sm}"
    forward.PREPARE_ITEMS_CTAS = grid
    case = make_case(seq_lens=[37, 0, 16, 1, 90], H=3, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=7)
    p = checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs(output_final_state=True))
    results = {}
    for items in (False, True):
        kda.cuda.K1_ITEMS = items
        with kda.record_dispatch() as events:
            results[items] = forward.chunk_forward(p)
        torch.cuda.synchronize()
        if ("cuda:prepare:items" in events) != items:
            failures.append(f"wgmma{ctas_an_sm} grid {grid}: items={items} but dispatch {events}")
    for name, one_each, walked in zip(("o", "state"), results[False], results[True], strict=True):
        if not torch.equal(one_each, walked):
            failures.append(f"wgmma{ctas_an_sm} grid {grid}: {name} differs")
print("items smoke:", "; ".join(failures) if failures else "the same bits on every case")
sys.exit(1 if failures else 0)
