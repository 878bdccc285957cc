"""Small CUDA-path calls for compute-sanitizer (memcheck, racecheck): varlen with an empty,
a one-token and a tail-chunk sequence, both state layouts, float32 and bfloat16 states, and
K1's far-row entry point (hard resets); then the decode kernel through a state pool with
padding and an out-of-range slot (varlen, float32; one token, bfloat16); then the training
forward's K2 with its checkpoints (the sequences cross checkpoint rows), checked against the
Triton forward's; then the backward's CUDA reverse chain and state products against Triton's,
and the products again from two CTAs (several items each); then a segment split against the
uncut call.
Exits non-zero on a wrong answer."""

import os
import sys

import torch

import kda
import kda.api
from kda.reference import relative_rms

sys.path.insert(0, "tests")
from helpers import fp64_reference, make_case  # noqa: E402

worst = 0.0
for layout, state_dtype in ((False, torch.float32), (True, torch.float32), (True, torch.bfloat16)):
    case = make_case(seq_lens=[0, 1, 37, 16], H=2, K=128, V=128, dtype=torch.bfloat16, state_v_first=layout,
                     device="cuda", seed=3)  # fmt: skip
    case.initial_state = case.initial_state.to(state_dtype)
    with kda.record_dispatch() as events:
        o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs(final_state_dtype=state_dtype))
    torch.cuda.synchronize()
    assert "cuda:recurrence" in events, events
    o_ref, ht_ref = fp64_reference(case)
    worst = max(worst, relative_rms(o.cpu(), o_ref), relative_rms(ht.cpu(), ht_ref))
# K1's far entry point (kda_prepare_far, ki in a tile of its own): a precomputed g with hard resets,
# whose rows past the exp2 limit take the pairwise form.
case = make_case(seq_lens=[0, 1, 37, 16], H=2, K=128, V=128, dtype=torch.bfloat16, gate="precomputed", device="cuda",
                 seed=6)  # fmt: skip
for t, h, channels in ((2, 0, [0, 1]), (9, 1, list(range(128))), (20, 0, [5]), (40, 1, [7])):
    case.g[0, t, h, channels] = -300.0
o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
torch.cuda.synchronize()
o_ref, ht_ref = fp64_reference(case)
far_worst = max(relative_rms(o.cpu(), o_ref), relative_rms(ht.cpu(), ht_ref))
worst = max(worst, far_worst)
for layout, state_dtype, lens in ((False, torch.float32, [3, 0, 1, 2]), (True, torch.bfloat16, [1, 1, 1, 1])):
    case = make_case(seq_lens=lens, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, state_v_first=layout,
                     device="cuda", seed=4)  # fmt: skip
    pool = torch.randn(5, 4, 128, 128, device="cuda").to(state_dtype)
    slots = [4, -1, 0, 7]  # padding and an index past the pool: nothing read, nothing written
    start = torch.stack([pool[s].float() if 0 <= s < 5 else torch.zeros_like(pool[0], dtype=torch.float32)
                         for s in slots])  # fmt: skip
    kw = case.kwargs(initial_state=pool)
    kw.pop("safe_gate")
    idx = torch.tensor(slots, device="cuda")
    with kda.record_dispatch() as events:
        o, _ = kda.fused_recurrent_kda(*case.tensors(), **kw, inplace_final_state=True, ssm_state_indices=idx,
                                       backend="cuda")  # fmt: skip
    torch.cuda.synchronize()
    assert "cuda:pooled_decode" in events, events
    case.initial_state = start
    o_ref, ht_ref = fp64_reference(case)
    worst = max(worst, relative_rms(o.cpu(), o_ref), relative_rms(pool[4].float().cpu(), ht_ref[0]))
case = make_case(seq_lens=[70, 1, 0, 130], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=5)
p = kda.api.checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
from kda.cuda.forward import chunk_forward  # noqa: E402
from kda.tables import chunk_tables  # noqa: E402
from kda.triton.training import checkpoint_shape, train_forward  # noqa: E402

rows = chunk_tables(p).checkpoint_offsets[-1].item()
checkpoints = torch.full(checkpoint_shape(p), float("nan"), device="cuda")
chunk_forward(p, checkpoints)
_, _, triton_checkpoints = train_forward(p)
torch.cuda.synchronize()
assert checkpoints[rows:].isnan().all(), "a checkpoint write past the real rows"
# (both round the state to bf16 operands, in different orders: tests/test_backward.py's bar)
apart = relative_rms(checkpoints[:rows].cpu(), triton_checkpoints[:rows].cpu())
assert apart < 1e-2, f"K2's checkpoints {apart:.2e} from Triton's"
from kda.cuda.training import state_grad_chain  # noqa: E402
from kda.triton.prepare import prepare_chunks  # noqa: E402
from kda.triton.state_grad import state_grad_chain as triton_chain  # noqa: E402

tables = chunk_tables(p)
real = int(tables.chunk_offsets[-1])
do = torch.randn(p.v.shape, device="cuda").to(torch.bfloat16)
dht = torch.randn(p.state_shape, device="cuda")
ours = torch.full((tables.num_chunks, p.H, p.V, p.K), float("nan"), dtype=torch.bfloat16, device="cuda")
theirs = torch.full_like(ours, float("nan"))
dh0, dh0_t = torch.full_like(dht, float("nan")), torch.empty_like(dht)
state_grad_chain(p, do, dht, dh0, ours)
triton_chain(p, tables, prepare_chunks(p, tables, torch.bfloat16, "tf32"), do, dht, dh0_t, theirs, True, "tf32")
torch.cuda.synchronize()
assert ours[real:].isnan().all(), "a chain write past the real chunks"
from kda.cuda.training import dstates_row_major  # noqa: E402

chain_apart = max(relative_rms(dstates_row_major(ours)[:real].float().cpu(), theirs[:real].float().cpu()),
                  relative_rms(dh0.cpu(), dh0_t.cpu()))  # fmt: skip
assert chain_apart < 2e-2, f"the CUDA chain {chain_apart:.2e} from Triton's"
from kda.cuda.training import k1_operands, product_scratch_numel, state_products  # noqa: E402
from kda.triton.chunk_grad import state_products as triton_products  # noqa: E402

workspace = state_grad_chain(p, do, dht, None, ours, tables)  # (a fresh workspace: the products read it)
size = product_scratch_numel(tables.num_chunks, p.H)
scratch, scratch_t = torch.full((size,), float("nan"), device="cuda"), torch.full((size,), float("nan"), device="cuda")
dv, dv_t = torch.full_like(p.v, float("nan")), torch.full_like(p.v, float("nan"))
state_products(p, do, checkpoints, ours, workspace, tables, scratch, dv)
triton_products(p, tables, k1_operands(workspace), do, checkpoints, ours, True, "tf32", True, scratch_t, dv_t)
torch.cuda.synchronize()
assert dv.isfinite().all() and scratch.isfinite().sum() == scratch_t.isfinite().sum(), "products: a value unwritten"
finite = scratch_t.isfinite()
products_apart = max(relative_rms(scratch[finite].cpu(), scratch_t[finite].cpu()),
                     relative_rms(dv.float().cpu(), dv_t.float().cpu()))  # fmt: skip
assert products_apart < 2e-2, f"the CUDA state products {products_apart:.2e} from Triton's"
import kda.cuda.training as cuda_training  # noqa: E402

cuda_training.sm_count = lambda index: 2  # two CTAs, each taking several items: the pipeline runs across them
scratch_2, dv_2 = torch.full_like(scratch, float("nan")), torch.full_like(dv, float("nan"))
state_products(p, do, checkpoints, ours, workspace, tables, scratch_2, dv_2)
torch.cuda.synchronize()
assert torch.equal(scratch_2[finite], scratch[finite]) and torch.equal(dv_2, dv), "products: two CTAs differ"
# The segment split (64-token segments): its two transition runs on one K1, the second taking v as
# zeros without reading it (the v_zero flag), against the uncut call.
case = make_case(seq_lens=[300, 7, 130], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=5)
case.g = case.g - 6.0  # long memory: a segment's entering state carries through it
os.environ["KDA_SEGMENT_TOKENS"] = "0"
uncut = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
os.environ["KDA_SEGMENT_TOKENS"] = "64"
with kda.record_dispatch() as events:
    split = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
torch.cuda.synchronize()
assert "segments:64" in events and events.count("cuda:prepare") == 1, events
split_apart = max(
    relative_rms(split[0].float().cpu(), uncut[0].float().cpu()), relative_rms(split[1].cpu(), uncut[1].cpu())
)
assert split_apart < 1e-2, f"the split {split_apart:.2e} from the uncut call"
print(f"cuda smoke: worst relative RMS {worst:.2e} (far rows {far_worst:.2e}); checkpoints {apart:.2e}, "
      f"chain {chain_apart:.2e}, products {products_apart:.2e} from Triton's; "
      f"split {split_apart:.2e} from uncut")  # fmt: skip
sys.exit(0 if worst <= 5e-3 else 1)
