"""Calls whose tensors pass 2^31 elements, where an index held in 32 bits would wrap: a
one-million-token prefill at H = 32 and D = 128 is 2^32 elements a tensor. Until 2026-12-05 no
GPU run had crossed 2^31 (the longest bench case, 1x2097152 H8, ends on element 2^31 - 1).

The forward checks are against the float64 token loop, on windows that the loop can afford: a
sequence whole, from its own initial state; and a long sequence's last tokens after a reset (24
tokens whose gate is at its lower bound, -5 a token: what enters the window is scaled by e^-120,
below float32's range), from a zero state. In the varlen case the short sequence lies wholly past
element 2^31 and the long one's window just below it; the time-blocks case's window is past it.
The training case checks its gradients against the same backend on each stretch alone. A wrapped
index reads or writes the wrong rows: an error of order one, or a fault. (A wrap that a kernel's
writer and reader of an internal tensor, such as K1's workspace, compute alike is seen only where
it overwrites live data or faults.)

Marked ``bigmem``: 20 to 60 GB of GPU memory a case (the prefill cases about 50: four bf16 inputs
of 4.3 GB, the CUDA workspace of 15 GB, the split's two output runs), and about 125 GB (117 GiB by
count since e2a9e96) for the training step whose inputs pass 2^31 (GRAD_SIZES), one at a time
under a file lock, so a parallel run (pytest -n) runs them in turn; skipped with the reason on a
smaller GPU."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile

import pytest
import torch

import kda
from helpers import (
    GRAD_INPUTS,
    Case,
    assert_close_fp64,
    cuda_ready,
    fp64_reference,
    recurrent_kwargs,
    rel,
    start_states,
)

pytestmark = [pytest.mark.gpu, pytest.mark.bigmem]

DEV = "cuda"
D = 128
PAST = 2**31  # elements
WINDOW, RESET = 64, 24  # tokens checked at the long sequence's end, and the reset before them
RESET_RAW = 1.0e4  # a raw gate that the lower-bound gate takes to its bound (sigmoid saturates)
# Errors of the window's o (bf16) and final state against float64: the paths sit at 2e-3 to 3e-3
# (README's accuracy table); a wrapped index gives an error of order one.
O_BAR, STATE_BAR = 1e-2, 1e-2
NEED_GB = 60  # the prefill cases' peak (Triton's uncut call) with room for the allocator


@contextlib.contextmanager
def alone_on_the_gpu(need_gb: int = NEED_GB):
    """One bigmem test at a time across pytest-xdist's workers, and skip where the GPU cannot
    hold one (the reason names the memory)."""
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < need_gb:
        pytest.skip(f"needs a GPU of {need_gb} GB or more (tensors past 2^31 elements), this one has {total:.0f}")
    with open(os.path.join(tempfile.gettempdir(), "kda-bigmem-tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # (a failed test's frames keep its tensors until the collector runs: without it, the
            # cases after a failure would find its memory taken and skip)
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0] / 2**30
            if free < need_gb:
                pytest.skip(f"needs {need_gb} GB of free GPU memory, {free:.0f} free (other processes hold the rest)")
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def big_case(lens: list[int], H: int, seed: int) -> Case:
    """Random bf16 inputs made on the GPU (a float32 detour would need 8.6 GB a tensor), the
    lower-bound gate, an initial state for every sequence."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=DEV, dtype=dtype)

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=DEV)
    return Case(
        q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, H, D), g=randn(1, T, H, D).mul_(2),
        beta=randn(1, T, H), initial_state=randn(len(lens), H, D, D, dtype=torch.float32), gate="lower_bound",
        A_log=torch.rand(H, generator=gen, device=DEV), dt_bias=torch.rand(H * D, generator=gen, device=DEV),
        cu_seqlens=cu if len(lens) > 1 else None,
    )  # fmt: skip


def window(case: Case, start: int, end: int, initial_state: torch.Tensor | None, lens: list[int] | None = None) -> Case:
    """Tokens [start, end) of ``case`` as a problem of its own, on the CPU (sequences of ``lens``
    tokens where given, else one)."""
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return Case(
        q=case.q[:, start:end].cpu(), k=case.k[:, start:end].cpu(), v=case.v[:, start:end].cpu(),
        g=case.g[:, start:end].cpu(), beta=case.beta[:, start:end].cpu(),
        initial_state=None if initial_state is None else initial_state.cpu(), gate=case.gate,
        A_log=case.A_log.cpu(), dt_bias=case.dt_bias.cpu(), cu_seqlens=cu,
    )  # fmt: skip


def unchanged_except(pool: torch.Tensor, before: torch.Tensor, named: list[int]) -> bool:
    """Every slot but ``named`` holds ``before``'s bits (compared 1024 slots at a time: a masked
    copy of the whole pool would take another 8.6 GB)."""
    for a in range(0, pool.shape[0], 1024):
        keep = [s for s in range(a, min(a + 1024, pool.shape[0])) if s not in named]
        if not torch.equal(pool[keep], before[keep]):
            return False
    return True


def reset_before_end(case: Case, end: int) -> int:
    """Saturate the gate on the RESET tokens before the last WINDOW ones of the sequence ending
    at ``end``; returns the reset's first token."""
    first = end - WINDOW - RESET
    case.g[:, first : end - WINDOW] = RESET_RAW
    return first


def check_long_end(case: Case, o, ht, n: int, end: int, first: int) -> None:
    """Sequence n's last WINDOW outputs and its final state: the float64 loop over the reset and
    the window, from zeros."""
    o_ref, ht_ref = fp64_reference(window(case, first, end, None))
    assert_close_fp64(o[:, end - WINDOW : end], o_ref[:, RESET:], O_BAR, f"o of sequence {n}'s last tokens")
    assert_close_fp64(ht[n], ht_ref[0], STATE_BAR, f"final state of sequence {n}")


@pytest.mark.parametrize(
    "backend, split",
    [
        pytest.param("cuda", "auto", marks=cuda_ready, id="cuda-split"),
        pytest.param("cuda", "0", marks=cuda_ready, id="cuda-uncut"),
        pytest.param("triton", "0", id="triton-uncut"),
        pytest.param("triton", "65536", id="triton-split"),
    ],
)
def test_gpu_varlen_prefill_past_two_to_the_31_elements(monkeypatch, backend, split):
    """A 2^21-token sequence at H = 8 (elements 0 to 2^31 - 1) and a 200-token one after it (all
    past 2^31), through chunk_kda: the segment split (automatic on CUDA, forced on Triton) and
    the uncut chunk pass."""
    if split == "auto":
        monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    else:
        monkeypatch.setenv("KDA_SEGMENT_TOKENS", split)
    H, T0, T1 = 8, PAST // (8 * D), 200
    with alone_on_the_gpu():
        case = big_case([T0, T1], H, seed=1301)
        first = reset_before_end(case, T0)
        with kda.record_dispatch() as events:
            o, ht = kda.chunk_kda(*case.tensors(), backend=backend, **case.kwargs())
        torch.cuda.synchronize()
        assert any(e.startswith(f"{backend}:") for e in events), events
        assert any(e.startswith("segments:") for e in events) == (split != "0"), events
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        check_long_end(case, o, ht, 0, T0, first)
        tail_ref = fp64_reference(window(case, T0, T0 + T1, case.initial_state[1:2]))
        assert_close_fp64(o[:, T0:], tail_ref[0], O_BAR, "o of the sequence past 2^31")
        assert_close_fp64(ht[1], tail_ref[1][0], STATE_BAR, "final state of the sequence past 2^31")


@cuda_ready
def test_gpu_one_sequence_past_two_to_the_31_elements_in_time_blocks(monkeypatch):
    """One sequence of 2^19 + 256 tokens at H = 32 (2^31 + 2^20 elements) on the CUDA path,
    which runs it in time blocks (K1 beside K2): its last outputs and final state."""
    monkeypatch.delenv("KDA_SEGMENT_TOKENS", raising=False)
    monkeypatch.delenv("KDA_CUDA_BLOCKS", raising=False)
    H = 32
    T = PAST // (H * D) + 256
    with alone_on_the_gpu():
        case = big_case([T], H, seed=1302)
        first = reset_before_end(case, T)
        with kda.record_dispatch() as events:
            o, ht = kda.chunk_kda(*case.tensors(), backend="cuda", **case.kwargs())
        torch.cuda.synchronize()
        assert any(e.startswith("cuda:blocks:") for e in events), events
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        check_long_end(case, o, ht, 0, T, first)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=cuda_ready), "triton"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_pool_slots_past_two_to_the_31_elements(backend, pool_dtype):
    """A state pool of 2^31 + 2^20 elements at H = 32: a decode step and a prefill through its
    last slot (all of it past element 2^31), a slot at its start, and padding; the slots not
    named keep their bits."""
    H = 32
    P = PAST // (H * D * D) + 2  # slots; the last one starts at element 2^31 + 2^19
    slots = [P - 1, 3, -1]
    with alone_on_the_gpu(need_gb=30):  # (the float32 pool, its copy and the comparisons' slices: about 22 GB)
        gen = torch.Generator(device=DEV).manual_seed(1303)
        pool = torch.randn(P, H, D, D, generator=gen, device=DEV, dtype=pool_dtype)
        before = pool.clone()
        start = start_states(before, slots, torch.float32)
        idx = torch.tensor(slots, dtype=torch.int64, device=DEV)
        step = big_case([1] * len(slots), H, seed=1304)  # one token a sequence
        with kda.record_dispatch() as events:
            o, out = kda.fused_recurrent_kda(
                *step.tensors(), **recurrent_kwargs(step, initial_state=pool), inplace_final_state=True,
                ssm_state_indices=idx, backend=backend,
            )  # fmt: skip
        torch.cuda.synchronize()
        assert out is pool and f"{backend}:pooled_decode" in events, events
        o_ref, ht_ref = fp64_reference(window(step, 0, len(slots), start, [1] * len(slots)))
        assert_close_fp64(o, o_ref, O_BAR, "decode o")
        for n, s in enumerate(slots[:2]):
            assert_close_fp64(pool[s].float(), ht_ref[n], STATE_BAR, f"slot {s} after the decode step")
        assert unchanged_except(pool, before, slots[:2]), "a slot not named changed"

        # the prefill (chunk_kda) into the same slots, from the states the decode step left
        after = pool[slots[:2]].float()
        prefill = big_case([40, 70], H, seed=1305)
        with kda.record_dispatch() as events:
            o, out = kda.chunk_kda(*prefill.tensors(), **prefill.kwargs(initial_state=pool),
                                   initial_state_indices=idx[:2], backend=backend)  # fmt: skip
        torch.cuda.synchronize()
        # (the pool's gather and scatter are the same code on either backend; the chunk pass between
        # them is the backend's)
        assert out is pool and any(e.startswith(f"{backend}:") for e in events), events
        o_ref, ht_ref = fp64_reference(window(prefill, 0, 110, after, [40, 70]))
        assert_close_fp64(o, o_ref, O_BAR, "prefill o")
        for n, s in enumerate(slots[:2]):
            assert_close_fp64(pool[s].float(), ht_ref[n], STATE_BAR, f"slot {s} after the prefill")
        assert unchanged_except(pool, before, slots[:2]), "a slot not named changed"


GRAD_BAR = 1e-2  # the same backend on the window alone: its own rounding apart (a wrap: order one)


def window_gradients(case: Case, backend: str, rows: list[tuple[int, int, torch.Tensor]], states) -> dict:
    """Gradients of ``sum(o[:, a:b] * do) + sum(final_state[n] * dht)`` (``rows``: (a, b, do);
    ``states``: (n, dht)) with respect to every input of ``case``, by ``backend``."""
    # Leaves over the case's own storage, not copies: at 2^21 tokens a copy of the four inputs is
    # 17 GB, and with it the "inputs" size needed about 145 GiB, past an H200's 139.8 (run 180,
    # 2026-12-06: out of memory at the local gradients' 26.5 GB scratch). Nothing writes them.
    inputs = {name: getattr(case, name).detach().requires_grad_() for name in GRAD_INPUTS}
    kw = case.kwargs(**{name: inputs[name] for name in ("initial_state", "A_log", "dt_bias")})
    o, ht = kda.chunk_kda(*(inputs[name] for name in ("q", "k", "v", "g", "beta")), backend=backend, **kw)
    loss = sum((o[:, a:b].float() * do).sum() for a, b, do in rows)
    loss = loss + sum((ht[n] * dht).sum() for n, dht in states)
    return dict(zip(GRAD_INPUTS, torch.autograd.grad(loss, list(inputs.values()))))


# Training's two sizes: the long sequence's tokens, and the GPU memory the call takes with room.
# "state": 2^18 tokens, so the per-chunk state gradients pass 2^31 elements and the inputs do not.
# "inputs": 2^21 tokens, the inputs past 2^31 as well: the checkpoints (float32, 17 GB), the state
# gradients (bf16, 34 GB), K1's workspace (15 GB), four inputs and their gradients (34 GB), the
# forward's o and its gradient, and the local gradients' float32 scratch (26.5 GB, left out of the
# first estimate): run 180 (an H200) ran out of memory near 145 GiB with the inputs copied; without the
# copy about 129 GiB by this count, and about 117 since e2a9e96 (dq, dk, dg, dbeta allocated after the
# state gradients are freed). So only a GPU of 125 GB or more runs it; the test prints its peak.
GRAD_SIZES = {"state": (PAST // (8 * 8 * D), 40), "inputs": (PAST // (8 * D), 125)}


@pytest.mark.parametrize("size", list(GRAD_SIZES))
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=cuda_ready), "triton"])
def test_gpu_gradients_past_two_to_the_31_elements(backend, size):
    """Training: a long sequence at H = 8 (GRAD_SIZES) and a 200-token one after it. At 2^18
    tokens the backward's state gradient of every chunk ([chunks, H, V, K], eight times an
    input's elements at D = 128) passes 2^31 elements, the second sequence's rows all past it; at
    2^21 tokens q, k, v, g, o and their gradients do too, the second sequence's rows all past
    element 2^31. The loss reads the long sequence's last WINDOW outputs (after a reset) and
    final state, and the short sequence's outputs and final state; each gradient against the same
    backend's on that stretch alone, the tokens before the reset at zero (what reaches them is
    scaled by e^-120)."""
    (T0, need_gb), H, T1 = GRAD_SIZES[size], 8, 200
    with alone_on_the_gpu(need_gb=need_gb):
        case = big_case([T0, T1], H, seed=1306)
        first = reset_before_end(case, T0)
        gen = torch.Generator(device=DEV).manual_seed(1307)
        do_w, do_t = (torch.randn(1, n, H, D, generator=gen, device=DEV) for n in (WINDOW, T1))
        dht = torch.randn(2, H, D, D, generator=gen, device=DEV)
        torch.cuda.reset_peak_memory_stats()
        with kda.record_dispatch() as events:
            big = window_gradients(case, backend, [(T0 - WINDOW, T0, do_w), (T0, T0 + T1, do_t)],
                                   [(0, dht[0]), (1, dht[1])])  # fmt: skip
        torch.cuda.synchronize()
        print(f"training peak {backend} {size}: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated")
        assert f"{backend}:state_grad_chain" in events, events  # the backward's reverse chain ran there

        def alone(start, end, initial_state):
            return window(case, start, end, initial_state).to(device=DEV)

        win = window_gradients(alone(first, T0, torch.zeros_like(case.initial_state[:1])), backend,
                               [(RESET, RESET + WINDOW, do_w)], [(0, dht[0])])  # fmt: skip
        tail = window_gradients(alone(T0, T0 + T1, case.initial_state[1:2]), backend, [(0, T1, do_t)],
                                [(0, dht[1])])  # fmt: skip
        for name in ("q", "k", "v", "g", "beta"):
            g = big[name]
            assert torch.isfinite(g).all(), name
            assert rel(g[:, first:T0], win[name]) <= GRAD_BAR, (name, "window", rel(g[:, first:T0], win[name]))
            assert rel(g[:, T0:], tail[name]) <= GRAD_BAR, (name, "tail", rel(g[:, T0:], tail[name]))
            scale = win[name].float().norm() / win[name].numel() ** 0.5
            leak = g[:, :first].float().norm() / g[:, :first].numel() ** 0.5
            assert leak <= 1e-6 * scale, (name, "before the reset", float(leak), float(scale))
        moved = rel(big["initial_state"][1:], tail["initial_state"])
        assert moved <= GRAD_BAR, ("initial_state", "tail", moved)
        leak = big["initial_state"][0].abs().max() / tail["initial_state"].abs().max()
        assert leak <= 1e-6, ("initial_state", "before the reset", float(leak))
        for name in ("A_log", "dt_bias"):  # sums over every token: the window's and the tail's
            assert rel(big[name], win[name] + tail[name]) <= GRAD_BAR, (name, rel(big[name], win[name] + tail[name]))
