"""The decode kernel's persistent launch against its default (kda.bench_decode.persistent_sweep):
graph-replay times on the GPU, written to $OUT (or benchmarks/results) as JSON."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch

from kda.bench import versions
from kda.bench_decode import persistent_sweep

if __name__ == "__main__":
    props = torch.cuda.get_device_properties(0)
    report = {"gpu": props.name, "date": datetime.date.today().isoformat(), "versions": versions()}
    report["sweep"] = persistent_sweep()
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"h200-{report['date']}-decode-persistent.json"
    path.write_text(json.dumps(report, indent=1))
    print("wrote", path)
