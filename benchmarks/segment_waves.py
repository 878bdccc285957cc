"""The segment split's length against the paired K2's waves (device runs; issue 13). Run 159
(2026-12-05, an H100, benchmarks/NOTES.md): flat, every length within the rounds' spread (2M H8
29.8-30.4 ms from 41 to 90 segments, whole waves or not); the automatic lengths stay.

``python benchmarks/segment_waves.py OUT.json CASE [TOKENS ...]``: CASE a ``kda bench --long`` case
number (default 3, 1x2097152 H8); TOKENS segment lengths (``KDA_SEGMENT_TOKENS``, multiples of 16).
Without TOKENS: the automatic length and, for whole waves 1 to 3 beyond and before it, the shortest
length whose paired K2 grid (two runs, two CTAs a (segment, head), ``forward.wgmma_grid``) fills
that many waves of two CTAs an SM. At 2M H8 the automatic 32768 tokens make 64 segments, 2048 CTAs
on 264 slots (7.76 waves, the last 76% full): 66 segments (31776 tokens) make 8 whole waves of
CTAs 3% shorter. The whole call at each length in turn, twice, then fla, do_bench medians in this
process, each with its waves."""

import datetime
import json
import os
import sys

import torch

from kda import segments
from kda.bench import contenders, make_inputs, versions
from kda.bench_long import LONG_CASES, timed_in_turn
from kda.cuda.forward import wgmma_grid

CTAS_PER_SM = 2  # the paired K2's CTAs an SM at these grids (runs_kind)


def paired_ctas(T: int, HV: int, tokens: int) -> int:
    return 2 * wgmma_grid(-(-T // tokens) * HV)


def lengths_for_whole_waves(T: int, HV: int, slots: int, auto: int) -> list[int]:
    """The automatic length and the shortest lengths (multiples of 16) whose grids fit whole waves
    near the automatic one's."""
    waves = -(-paired_ctas(T, HV, auto) // slots)
    out = [auto]
    for w in range(max(1, waves - 3), waves + 4):
        segs = w * slots // paired_ctas(1, HV, 1)  # the most segments that fill w waves
        tokens = (-(-T // segs) + 15) // 16 * 16 if segs else 0  # ceil(T / segs), up to a multiple of 16
        if tokens and tokens not in out and paired_ctas(T, HV, tokens) <= w * slots:
            out.append(tokens)
    return out


out_path = sys.argv[1]
case = LONG_CASES[int(sys.argv[2]) if len(sys.argv) > 2 else 3]
(T,), HV = case["seq_lens"], case["H"]
sms = torch.cuda.get_device_properties(0).multi_processor_count
slots = CTAS_PER_SM * sms
auto = segments.auto_span([T], HV, sms)
spans = [int(x) for x in sys.argv[3:]] or lengths_for_whole_waves(T, HV, slots, auto)
report = {"case": case["name"], "gpu": torch.cuda.get_device_name(), "versions": versions(),
          "date": datetime.date.today().isoformat(), "auto": auto, "slots": slots,
          "spans": {t: {"segments": -(-T // t), "ctas": paired_ctas(T, HV, t),
                        "waves": paired_ctas(T, HV, t) / slots} for t in spans}}  # fmt: skip
for t, row in report["spans"].items():
    print(f"{case['name']}: {t} tokens, {row['segments']} segments, {row['ctas']} CTAs, {row['waves']:.2f} waves")


def use(tokens):
    return lambda: os.environ.__setitem__(segments.SETTING, str(tokens))


tensors, kw = make_inputs(case)
report["call"] = timed_in_turn(contenders(), tensors, kw, [(str(t), use(t)) for t in spans] * 2 + [("fla", None)])
os.environ.pop(segments.SETTING, None)
with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
