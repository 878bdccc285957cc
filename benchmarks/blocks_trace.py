"""Where a call in time blocks spends its time (device runs):

python benchmarks/blocks_trace.py [--cases NAMES] [--blocks 8] [--priority high|equal] [--k1-ctas N]

Per case (blocks_ab.CASES): the uncut call's K1 and K2 (torch profiler, ms a call), the blocked
call's K1 and K2 summed over the blocks (a kernel that shares the SMs takes longer than alone),
both calls' do_bench medians, and the blocked call's timeline: from one start event, when each
block's K1 and K2 finished (events recorded after each launch on its stream), and how long each
K2 ran after both its K1 and the K2 before it were done. ``--priority equal`` gives the
recurrence stream the default priority instead of the highest (a stream from torch's pool; runs
87-90 ran the blocks on a pool stream at the highest priority, before kda made streams of its
own); ``--k1-ctas N`` launches K1 with dynamic shared memory it does not use, so that at most N
of its CTAs fit an SM beside a two-warp split-K recurrence CTA (fewer of K1's warps to share the
SM with K2's chain)."""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from blocks_ab import CASES, switch

import kda
from kda import bench
from kda.cuda import forward, loader

SM_SHARED = 228 * 1024  # bytes an SM holds for CTAs
CTA_RESERVED = 1024  # bytes an SM reserves a CTA


def cap_prepare(ctas: int) -> int:
    """K1's launches from now on pad their shared memory so that at most ``ctas`` fit an SM
    beside one kda_recurrence_w2k2 CTA; the pad in bytes."""
    kernels = loader.kernels()
    driver = kernels.driver
    device = driver.cuDeviceGet(torch.cuda.current_device())[1]
    attributes = driver.CUfunction_attribute
    beside = SM_SHARED - (loader.RECURRENCE_KERNELS[2, 2][1] + CTA_RESERVED)
    pads = {}
    for name in (n for n in kernels.kernels if n.startswith("kda_prepare")):
        static = driver.cuKernelGetAttribute(
            attributes.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernels.kernels[name], device
        )[1]
        pads[name] = max(0, beside // (ctas + 1) + 16 - CTA_RESERVED - static)
        driver.cuKernelSetAttribute(
            attributes.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, pads[name], kernels.kernels[name], device
        )
    launch = kernels.launch

    def padded(name, grid, threads, smem, stream, block="chunk"):
        return launch(name, grid, threads, pads.get(name, smem), stream, block)

    kernels.launch = padded
    return pads[forward.abi.PREPARE_KERNEL]


def traced_call(tensors, kw) -> list[tuple[str, float]]:
    """One blocked call: (kernel, ms from the start) of a timing event after each launch, on its stream."""
    marks = []
    launch = forward._launch

    def recorded(*args, run_recurrence=True, **kwargs):
        launch(*args, run_recurrence=run_recurrence, **kwargs)
        stream = torch.cuda.ExternalStream(args[7])
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        marks.append(("K2" if run_recurrence else "K1", event))

    start = torch.cuda.Event(enable_timing=True)
    start.record()
    forward._launch = recorded
    try:
        kda.chunk_kda(*tensors, backend="cuda", **kw)
    finally:
        forward._launch = launch
    torch.cuda.synchronize()
    return [(kind, start.elapsed_time(event)) for kind, event in marks]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="1x32768-H32,1x131072-H32")
    parser.add_argument("--blocks", default="8")
    parser.add_argument("--priority", default="high", choices=("high", "equal"))
    parser.add_argument("--k1-ctas", type=int, default=0, help="at most this many K1 CTAs an SM beside K2 (0: no cap)")
    args = parser.parse_args()
    if args.priority == "equal":
        pair = forward.stream_pair

        def equal_priority(device_index, stream, kernels):
            key = (device_index, stream)
            if key not in forward._recurrence_streams:
                forward._recurrence_streams[key] = torch.cuda.Stream(device_index)
            return pair(device_index, stream, kernels)

        forward.stream_pair = equal_priority
    for name in args.cases.split(","):
        tensors, kw = bench.make_inputs(dict(CASES[name], name=name))
        row = {"case": name, "priority": args.priority, "blocks": int(args.blocks), "k1 ctas": args.k1_ctas}
        call = lambda: kda.chunk_kda(*tensors, backend="cuda", **kw)  # noqa: E731
        for label, blocks in (("uncut", "1"), ("blocked", args.blocks)):
            switch("KDA_CUDA_BLOCKS", blocks)
            if label == "blocked" and args.k1_ctas and "k1 pad" not in row:
                call()  # (the kernels are loaded)
                row["k1 pad"] = cap_prepare(args.k1_ctas)
            row[f"{label} ms"] = triton.testing.do_bench(call, warmup=25, rep=500, return_mode="median")
            row[f"{label} kernels"] = bench.kernel_times(call)
        traced_call(tensors, kw)  # (warm)
        marks = traced_call(tensors, kw)
        switch("KDA_CUDA_BLOCKS", None)
        k1 = [t for kind, t in marks if kind == "K1"]
        k2 = [t for kind, t in marks if kind == "K2"]
        row["K1 done"] = [round(t, 3) for t in k1]
        row["K2 done"] = [round(t, 3) for t in k2]
        row["K2 ran"] = [round(t - max(k1[j], k2[j - 1] if j else 0.0), 3) for j, t in enumerate(k2)]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
