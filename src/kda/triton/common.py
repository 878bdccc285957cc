"""Pieces the Triton stages share: the gate's fast-path test, the interpreter's state and
autotune configs (the chunk size, checkpoints and chunk tables are :mod:`kda.tables`')."""

from __future__ import annotations

import functools
import itertools
import os

import torch
import triton
import triton.language as tl

from kda.validation import SAFE_LOWER_BOUND_MIN


def safe_gate_path(p) -> bool:
    """Whether the kernels may compile out the far-row and reset paths: the lower-bound gate
    with ``lb >= validation.SAFE_LOWER_BOUND_MIN`` keeps every 16-token decay inside
    ``prepare.EXP2_LIMIT`` (``16 * 5 / ln 2 < 116``) and never resets."""
    return p.gate_form == "lower_bound" and p.lower_bound >= SAFE_LOWER_BOUND_MIN


# Read once, when this module (and so every kernel of kda.triton) is defined: triton.jit takes
# its mode from TRITON_INTERPRET at definition, so a later change of the variable (a test
# setting it for child processes, seen 2026-12-01 on the H200) changes nothing here either.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when kda's kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU
    tensors through numpy)."""
    return _INTERPRETING


@triton.jit
def _loop_bound_probe(offsets, out):
    total = 0
    for i in tl.range(tl.load(offsets), tl.load(offsets + 1)):
        total += i
    tl.store(out, total)


@functools.cache
def interpreter_fault() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None. Seen 2026-12-01: Triton
    3.6.0's interpreter with NumPy 2.4 fails on every loop whose bounds are loaded from memory
    (it calls int() on a one-element array, which NumPy 2.4 refuses); NumPy 2.3 or Triton 3.9
    run it. Probed once with a loop of that form rather than by version numbers."""
    # Outside any torch.func transform and any dispatch mode: the answer is cached for the
    # process, and a first call under torch.func.grad (wrapped tensors) or under FakeTensorMode
    # or make_fx (fake tensors) gave the interpreter tensors it cannot read, and cached a false
    # NumPy fault (two reviews of 2026-12-07).
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with torch._C._DisableFuncTorch(), _disable_current_modes():
            # (on the CPU by name: a torch.device("meta") block is a function mode, not a dispatch one)
            offsets, out = torch.tensor([2, 5], device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
            _loop_bound_probe[(1,)](offsets, out)
            total = out.item()  # (read inside too: outside, a FakeTensorMode would take the read)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the answer
        import numpy

        return (f"Triton {triton.__version__}'s interpreter fails with NumPy {numpy.__version__} on loop bounds "
                f"loaded from memory ({type(e).__name__}); install numpy<2.4 or a newer Triton")  # fmt: skip
    return None if total == 9 else f"Triton {triton.__version__}'s interpreter miscounts a loop (got {total})"


def autotune_configs(params: list[dict], warps: tuple[int, ...], stages: tuple[int, ...]) -> list[triton.Config]:
    """Every combination of ``params`` x warps x stages. Only the first (the first listed
    value of each) under the interpreter, which cannot time kernels, or with
    ``KDA_TRITON_AUTOTUNE=0`` (test runs that would otherwise tune dozens of shapes). A
    ``maxnreg`` key of a params dict caps ptxas' registers per thread for that config."""
    combos = list(itertools.product(params, warps, stages))
    if interpreting() or os.environ.get("KDA_TRITON_AUTOTUNE", "1") == "0":
        combos = combos[:1]
    configs = []
    for kw, nw, ns in combos:
        kw = dict(kw)
        maxnreg = kw.pop("maxnreg", None)
        configs.append(triton.Config(kw, num_warps=nw, num_stages=ns, maxnreg=maxnreg))
    return configs
