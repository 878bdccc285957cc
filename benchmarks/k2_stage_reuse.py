"""K2 on sequences longer than its pipeline (more chunks than abi.STAGES, so every stage is
refilled), for compute-sanitizer racecheck: ``python benchmarks/k2_stage_reuse.py infer`` (an
inference call) or ``train`` (the training forward, K2 writing checkpoints). run 31
(2026-12-02) had racecheck report hazards between the producer's bulk copies into a stage and
the consumers' reads of it on the first smoke case that refilled stages; this tells whether the
checkpoint stores matter."""

import sys

import torch

import kda
import kda.api
from kda.cuda.forward import chunk_forward
from kda.triton.training import checkpoint_shape

sys.path.insert(0, "tests")
from helpers import make_case  # noqa: E402

case = make_case(seq_lens=[130, 70], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=5)
p = kda.api.checked_problem(kda.chunk_kda, *case.tensors(), **case.kwargs())
checkpoints = torch.empty(checkpoint_shape(p), device="cuda") if sys.argv[1:] == ["train"] else None
chunk_forward(p, checkpoints)
torch.cuda.synchronize()
print("ran", sys.argv[1:])
