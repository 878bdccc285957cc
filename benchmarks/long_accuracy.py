"""Accuracy of one long sequence against float64 (issue 13: no worse than the anchors' o 2.9e-3,
state 2.4e-3 on a sequence of a million tokens): ``python benchmarks/long_accuracy.py [T] [H]``
(default 1048576 tokens, 8 heads) on a GPU.

Inputs as ``kda bench`` (kda.bench.make_inputs: bf16, K = V = 128, the lower-bound gate, l2norm
and beta sigmoid in the kernel, fp32 states), with the raw gate as timed and lowered by
bench_long.SPLIT_CHECK_GATE_SHIFT (long memory: the state entering a segment carries through it).
The yardstick: reference.segmented_chunk16_kda(two_pass=True) in float64 on the GPU, the chunk
form's function with all segments of the sequence batched (tests/test_reference.py holds it to the chunk
form at 1e-12), from the same activated inputs. Compared: kda-cuda as dispatched (the automatic
segment split where kda.segments.auto_span takes it), kda-cuda uncut (KDA_SEGMENT_TOKENS=0) and
fla's chunk_kda; relative RMS of o and of the final state. Prints the table and one JSON line."""

import json
import sys
import time

import torch

import kda
from kda import reference
from kda.api import checked_problem
from kda.bench import contenders, make_inputs, versions
from kda.bench_long import SPLIT_CHECK_GATE_SHIFT, with_segments
from kda.torch_backend import activated_inputs

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
H = int(sys.argv[2]) if len(sys.argv) > 2 else 8
SEGMENT_CHUNKS = 1024  # the yardstick's segments: 16384 tokens, 64 of them at 2^20 tokens

calls = {name: call for name, call in contenders().items() if name in ("kda-cuda", "fla")}
calls["kda-cuda-uncut"] = lambda t, kw: with_segments(0, lambda: kda.chunk_kda(*t, backend="cuda", **kw))()
tensors, kw = make_inputs({"seq_lens": [T], "H": H})
out = {"case": f"1x{T} H{H}", "gpu": torch.cuda.get_device_name(), "versions": versions(), "rows": []}
for gate_shift in (0.0, SPLIT_CHECK_GATE_SHIFT):
    q, k, v, g, beta = tensors
    inputs = (q, k, v, g - gate_shift, beta)
    results = {}
    with torch.inference_mode():
        with kda.record_dispatch() as events:
            for name, call in calls.items():
                o, h = call(inputs, kw)
                results[name] = (o, h)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # (the calls' workspaces: the float64 yardstick needs about 80 GB at 2^20 x 8)
        start = time.perf_counter()
        p = checked_problem(kda.chunk_kda, *inputs, **kw)
        h0 = p.initial_state.double().transpose(-1, -2)  # fp32 [N, H, V, K] -> the reference's [N, H, K, V]
        o_ref, h_ref = reference.segmented_chunk16_kda(
            *activated_inputs(p, torch.float64), scale=p.scale, initial_state=h0, output_final_state=True,
            segment_chunks=SEGMENT_CHUNKS, two_pass=True,
        )  # fmt: skip
        h_ref = h_ref.transpose(-1, -2)  # back to [N, H, V, K], the calls' layout
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        del p
        for name, (o, h) in results.items():
            row = {"gate_shift": gate_shift, "impl": name, "o": reference.relative_rms(o, o_ref),
                   "final_state": reference.relative_rms(h, h_ref), "fp64_seconds": seconds}  # fmt: skip
            out["rows"].append(row)
            print(
                f"{out['case']} gate -{gate_shift:g} {name}: o {row['o']:.3e} state {row['final_state']:.3e}",
                flush=True,
            )
        out.setdefault("dispatch", []).append([e for e in events if e.startswith(("segments", "chunk_kda"))][:6])
        del results, o_ref, h_ref
        torch.cuda.empty_cache()
print(json.dumps(out))
