"""A NaN in an input reaches the outputs it feeds, never a silent number, and no other sequence's
or head's. (An adversarial review of 2026-12-07 found the softplus gate's floor, a Triton
``tl.maximum`` that drops NaN, turning a NaN gate into a hard reset: o and the final state came
back finite on the Triton path, NaN on the torch path.)"""

from __future__ import annotations

import pytest
import torch

import kda
import kda.cuda
from helpers import AUTO, cuda_ready, make_case, recurrent_kwargs

POISON_TOKEN = 9  # of sequence 0 (lengths below), head 0
SEQ_LENS = [20, 12]


def poisoned_case(gate: str, name: str, device: str, dtype: torch.dtype, K: int, seed: int):
    """Two sequences, two heads; one NaN in ``name`` at sequence 0's token POISON_TOKEN, head 0."""
    case = make_case(seq_lens=SEQ_LENS, H=2, K=K, V=K, gate=gate, dtype=dtype, device="cpu", seed=seed)
    case = case.to(dtype, device)
    if case.A_log is not None:  # (the gate's parameters as the API takes them: float32)
        case.A_log, case.dt_bias = case.A_log.float(), case.dt_bias.float()
    x = getattr(case, name)
    if name == "beta":
        x[0, POISON_TOKEN, 0] = float("nan")
    else:
        x[0, POISON_TOKEN, 0, 3] = float("nan")
    return case


def assert_nan_reaches_only_its_outputs(o: torch.Tensor, ht: torch.Tensor) -> None:
    head0_seq0 = o[0, POISON_TOKEN : SEQ_LENS[0], 0].float()
    # every token from the poisoned one on reads the state's NaN row (q has no zero element)
    assert head0_seq0.isnan().any(dim=-1).all(), "a NaN input left outputs of its own sequence finite"
    assert ht[0, 0].isnan().any(), "a NaN input left its sequence's final state finite"
    assert o[0, SEQ_LENS[0] :].isfinite().all(), "the NaN reached the other sequence's outputs"
    assert o[0, :, 1].isfinite().all(), "the NaN reached the other head's outputs"
    assert ht[1].isfinite().all() and ht[0, 1].isfinite().all(), "the NaN reached another final state"


def kwargs(op: str, case) -> dict:
    return case.kwargs() if op == "chunk_kda" else recurrent_kwargs(case)


def run(op: str, case, backend: str):
    return getattr(kda, op)(*case.tensors(), **kwargs(op, case), backend=backend)


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("gate", ["precomputed", "lower_bound", "softplus"])
@pytest.mark.parametrize("name", ["g", "beta", "k"])
@pytest.mark.parametrize("backend", ["torch", AUTO])
def test_nan_input_reaches_its_outputs_and_no_others(op, gate, name, backend):
    device = "cuda" if backend == "auto" else "cpu"
    case = poisoned_case(gate, name, device, torch.float32, K=16, seed=31)
    o, ht = run(op, case, backend)
    assert_nan_reaches_only_its_outputs(o, ht)


@pytest.mark.gpu
@cuda_ready
@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("gate", ["precomputed", "lower_bound"])
@pytest.mark.parametrize("name", ["g", "beta", "k"])
def test_gpu_cuda_nan_input_reaches_its_outputs_and_no_others(op, gate, name):
    """The CUDA backend's kernels (K1 and K2; the decode kernel for fused_recurrent_kda), bf16 inputs
    at K = V = 128, as the Triton and torch paths above."""
    from kda.api import checked_problem

    case = poisoned_case(gate, name, "cuda", torch.bfloat16, K=128, seed=32)
    with kda.record_dispatch() as events:
        o, ht = run(op, case, "cuda")
    p = checked_problem(getattr(kda, op), *case.tensors(), **kwargs(op, case))
    assert ("cuda:decode" if kda.cuda._decodes(p) else "cuda:recurrence") in events, events
    assert_nan_reaches_only_its_outputs(o, ht)
