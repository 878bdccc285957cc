"""The GPU's SM clock, power and throttle reasons while ``kda bench`` times, so that every
figure says what clock it ran at.

Why (benchmarks/NOTES.md, run 100, H200, 2026-12-04): the same kda-cuda call on 1x8192 H96 read
0.910 ms in its first do_bench of a fresh process and 0.975-0.982 ms in every later one, before
fla had run at all and with the caching allocator unchanged (no device allocation between them).
nvidia-smi showed the SM clock at 1980 MHz for the first and 1815-1860 MHz under the software
power cap (throttle reason 0x4) for the others, the board drawing up to 690 W; fla's call kept 1980 MHz
(at 614-654 W when run back to back, run 117; the "about 300 W" first noted was read from short
windows). A figure is then a figure at a clock, and the clock depends on what
the card ran in the seconds before.

``ClockSampler`` runs ``nvidia-smi -lms`` in the background for the device and keeps its samples
with their host times; ``windows(spans)`` summarises the samples of each timed ``(t0, t1)``
span once its last sample can have arrived (``window`` one span at once). Without
nvidia-smi (or on a machine whose driver refuses the query) it samples nothing and every window
is None: the bench's figures do not depend on it."""

from __future__ import annotations

import atexit
import shutil
import statistics
import subprocess
import threading
import time

# nvmlClocksThrottleReasonSwPowerCap (nvml.h): the driver lowers the clocks to hold the power limit.
SW_POWER_CAP = 0x4
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
PERIOD_MS = 100


def parse_line(line: str) -> tuple[float, float, int] | None:
    """``(SM MHz, power W, throttle reason bits)`` of one ``--format=csv,noheader,nounits`` line,
    or None for a line the query could not fill (``[N/A]``, ``[Not Supported]``, an error)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        return None
    try:
        return float(fields[0]), float(fields[1]), int(fields[2], 16)
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float, int]]) -> dict | None:
    """Median SM clock, highest power and the share of samples under the software power cap, of
    ``(SM MHz, power W, reasons)`` samples; None for none."""
    if not samples:
        return None
    return {
        "sm_mhz": statistics.median(s[0] for s in samples),
        "power_w_max": max(s[1] for s in samples),
        "power_capped": sum(bool(s[2] & SW_POWER_CAP) for s in samples) / len(samples),
        "samples": len(samples),
    }


def device_selector(device_index: int) -> str:
    """nvidia-smi's ``-i`` for torch's device ``device_index``: its PCI address, which holds
    whatever CUDA_VISIBLE_DEVICES renumbered."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:  # a torch without the PCI fields: the index, right without CUDA_VISIBLE_DEVICES
        return str(device_index)


class ClockSampler:
    """nvidia-smi's samples of one device, every PERIOD_MS, kept with their host arrival times."""

    def __init__(self, device_index: int = 0, command: list[str] | None = None):
        self.samples: list[tuple[float, tuple[float, float, int]]] = []
        self._proc = None
        exe = shutil.which("nvidia-smi") if command is None else command[0]
        if exe is None:
            return
        if command is None:
            command = [exe, "-i", device_selector(device_index), f"--query-gpu={QUERY}"]
            command += ["--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)]
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        atexit.register(self.close)  # a bench that raises between here and close() leaves no sampler running

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                self.samples.append((time.time(), sample))

    def window(self, t0: float, t1: float) -> dict | None:
        """The samples that arrived from ``t0`` to one period after ``t1`` (a sample describes
        the period before it), summarised."""
        late = t1 + PERIOD_MS / 1000
        return summarize([s for at, s in list(self.samples) if t0 <= at <= late])

    def windows(self, spans: list[tuple[float, float]]) -> list[dict | None]:
        """:meth:`window` of each ``(t0, t1)`` span, once the last span's trailing sample can have
        arrived: a window asked for at its own ``t1`` would miss the sample that describes its
        last period (a review, 2026-12-04: the benches read their windows at once). Waits at
        most one period, and not at all without a running sampler."""
        if self._proc is not None and spans:
            wait = max(t1 for _, t1 in spans) + PERIOD_MS / 1000 - time.time()
            if wait > 0:
                time.sleep(wait)
        return [self.window(t0, t1) for t0, t1 in spans]

    def __enter__(self) -> ClockSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=1)
            self._proc = None
