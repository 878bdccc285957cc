"""Context parallelism over torch.distributed (kda.context_parallel): ranks holding contiguous
slices of the tokens give the unsharded call's outputs on their tokens and its final state.
CPU: gloo, spawned processes, the torch backend and Triton under the interpreter."""

from __future__ import annotations

import datetime
import functools
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import kda
from helpers import make_case, rel

T_LOCAL = 20  # not a multiple of 16: rank boundaries fall inside the unsharded call's chunks


def _worker(rank, world, store, backend, layout, with_h0, mismatch):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        case = make_case(B=2, T=world * T_LOCAL, H=1, HV=2, K=16, V=8, gate="softplus", state_v_first=layout,
                         with_state=with_h0, seed=71)  # fmt: skip
        kw = case.kwargs()
        o_all, ht_all = kda.chunk_kda(*case.tensors(), backend=backend, **kw)
        span = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL - (1 if mismatch and rank == 1 else 0))
        local = [x[:, span].contiguous() for x in case.tensors()]
        if mismatch:
            with pytest.raises(ValueError, match="differ in shape"):
                kda.chunk_kda(*local, backend=backend, cp_group=dist.group.WORLD, **kw)
            return
        o, ht = kda.chunk_kda(*local, backend=backend, cp_group=dist.group.WORLD, **kw)
        assert rel(o, o_all[:, span]) <= 1e-5, (rank, rel(o, o_all[:, span]))
        assert rel(ht, ht_all) <= 1e-5, (rank, rel(ht, ht_all))
    finally:
        dist.destroy_process_group()


@functools.cache
def interpreter_refusal() -> str:
    """What the Triton backend says of itself under TRITON_INTERPRET=1, asked in a fresh
    interpreter: this process may have imported Triton for the GPU, which fixes the mode."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from kda.triton import BACKEND; print(BACKEND.availability() or '')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def spawn(tmp_path, monkeypatch, world, backend, layout=False, with_h0=True, mismatch=False):
    if backend == "triton" and (why := interpreter_refusal()):
        pytest.skip(f"Triton under the interpreter is unavailable here: {why}")
    # The children inherit it (Triton on CPU tensors); monkeypatch restores this process's.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), backend, layout, with_h0, mismatch), nprocs=world)


@pytest.mark.parametrize(
    "world, backend, layout, with_h0",
    [(2, "torch", False, True), (2, "triton", True, True), (4, "torch", True, False), (4, "triton", False, True)],
)
def test_sharded_call_equals_the_unsharded_one(tmp_path, monkeypatch, world, backend, layout, with_h0):
    spawn(tmp_path, monkeypatch, world, backend, layout, with_h0)


def test_ranks_with_different_slices_fail_on_every_rank(tmp_path, monkeypatch):
    spawn(tmp_path, monkeypatch, 2, "torch", mismatch=True)


def test_cp_group_refusals():
    case = make_case(B=1, T=20, H=1, K=16, V=8, seed=72)
    with pytest.raises(ValueError, match="initialised torch.distributed"):
        kda.chunk_kda(*case.tensors(), cp_group=object(), **case.kwargs())
