"""The split's boundary chain in one Triton kernel (kda.triton.segments.chain_states, the default
on a GPU since 2026-12-05) against the torch chain it replaced (blocks of about the square root of
the segments, chain_blocks), alone and in the whole long call (device runs).

``python benchmarks/chain_ab.py OUT.json [CASE ...]``: CASE ``kda bench --long`` case numbers
(default 3, 1x2097152 H8). For each: the chain alone on the call's shapes (its segments as the
automatic split cuts them; contractive random float32 transitions, float64 S0), do_bench medians
of the kernel, the torch blocks and the torch steps, and each one's largest relative RMS against
the steps; then the whole call (``kda-cuda``) with the kernel and with the torch blocks, in turn,
twice, and fla once, do_bench medians in this process. Written for issue 13: in run 150 (H200)
the torch chain of the 2M H8 call was about 90 small kernels, 1.1 ms of them, and the call's wall
time 1.1 ms above its kernels' sum."""

import datetime
import json
import sys

import torch
import triton.testing

from kda import segments
from kda.bench import contenders, make_inputs, versions
from kda.bench_long import LONG_CASES, timed_in_turn
from kda.reference import relative_rms
from kda.triton.segments import chain_states

KERNEL = segments.chain_boundaries  # (the default on a GPU: the kernel)


def torch_blocks(P, R, S0, counts):
    """The chain as it was before the kernel: the torch chain's blocks (segments.torch_block)."""
    return KERNEL(P, R, S0, counts, block=segments.torch_block(counts))


def chain_alone(row: dict, HV: int, K: int, counts: list[int]) -> None:
    """The chain alone, each form: do_bench median and largest relative RMS against the steps."""
    gen = torch.Generator(device="cuda").manual_seed(counts[0])
    P = torch.randn(counts[0], HV, K, K, generator=gen, device="cuda") * (0.9 / K**0.5)
    R = torch.randn(counts[0], HV, K, K, generator=gen, device="cuda")
    S0 = torch.randn(1, HV, K, K, generator=gen, device="cuda", dtype=torch.float64)
    forms = {
        "kernel": lambda: chain_states(P, R, S0, counts),
        "torch blocks": lambda: torch_blocks(P, R, S0, counts),
        "torch steps": lambda: segments.chain_steps(P, R, S0, counts),
    }
    ref = forms["torch steps"]()
    for name, form in forms.items():
        row["chain_ms"][name] = triton.testing.do_bench(form, warmup=25, rep=200, return_mode="median")
        row["chain_rel_rms"][name] = max(relative_rms(a, b) for a, b in zip(form(), ref))
        print(f"{row['case']} chain alone, {name}: {row['chain_ms'][name]:.3f} ms, rel RMS "
              f"{row['chain_rel_rms'][name]:.2e}", flush=True)  # fmt: skip


def whole_call(row: dict, case: dict, calls: dict) -> None:
    """The call with each chain, in turn, twice, then fla."""

    def use(chain):
        return lambda: setattr(segments, "chain_boundaries", chain)

    tensors, kw = make_inputs(case)
    variants = [("kernel", use(KERNEL)), ("torch blocks", use(torch_blocks))] * 2 + [("fla", None)]
    row["call"] = timed_in_turn(calls, tensors, kw, variants, f"{row['case']} ")
    segments.chain_boundaries = KERNEL


out_path = sys.argv[1]
sms = torch.cuda.get_device_properties(0).multi_processor_count
report = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "date": datetime.date.today().isoformat(),
          "cases": []}  # fmt: skip
calls = contenders()
for number in [int(x) for x in sys.argv[2:]] or [3]:
    case = LONG_CASES[number]
    (T,), HV = case["seq_lens"], case["H"]
    span = segments.auto_span([T], HV, sms)
    counts = [-(-T // span)] if span else [1]
    row = {"case": case["name"], "span": span, "segments": counts[0], "chain_ms": {}, "chain_rel_rms": {}, "call": []}
    chain_alone(row, HV, 128, counts)
    torch.cuda.empty_cache()
    whole_call(row, case, calls)
    torch.cuda.empty_cache()
    report["cases"].append(row)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
