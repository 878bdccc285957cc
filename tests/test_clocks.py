"""kda.clocks, the bench's record of the GPU's clock: parsing nvidia-smi's lines, summarising a
timed span's samples, and the background sampler on a stand-in command (CPU-checkable)."""

import sys
import time

from kda import clocks


def test_lines_parse_and_lines_the_query_could_not_fill_are_dropped():
    assert clocks.parse_line("1830, 612.34, 0x0000000000000004\n") == (1830.0, 612.34, 4)
    assert clocks.parse_line("1980, 81.59, 0x0000000000000000") == (1980.0, 81.59, 0)
    for bad in ("[N/A], 80.0, 0x0", "1980, [Not Supported], 0x0", "No devices were found", "1, 2", ""):
        assert clocks.parse_line(bad) is None, bad


def test_summary_takes_the_median_clock_the_highest_power_and_the_capped_share():
    samples = [(1980.0, 300.0, 0), (1830.0, 690.0, clocks.SW_POWER_CAP), (1845.0, 650.0, clocks.SW_POWER_CAP | 1)]
    assert clocks.summarize(samples) == {"sm_mhz": 1845.0, "power_w_max": 690.0, "power_capped": 2 / 3, "samples": 3}
    assert clocks.summarize([]) is None


def test_sampler_keeps_a_commands_lines_and_windows_them_by_arrival_time():
    """A stand-in for nvidia-smi prints two samples 0.3 s apart: each window sees the sample that
    arrived in it or up to one period after it (a sample describes the period before it), and
    closing the sampler stops its command at once rather than waiting for it to end."""
    script = (
        "import time\nprint('1980, 100.0, 0x0', flush=True)\ntime.sleep(0.3)\n"
        "print('1830, 690.0, 0x4', flush=True)\ntime.sleep(30)"
    )
    start = time.time()
    with clocks.ClockSampler(command=[sys.executable, "-c", script]) as sampler:
        deadline = time.time() + 20
        while len(sampler.samples) < 2 and time.time() < deadline:
            time.sleep(0.05)
        proc = sampler._proc
        closing = time.time()
    assert time.time() - closing < 5, "close waited for the stand-in's 30 s instead of stopping it"
    assert proc.poll() is not None, "the stand-in still runs after the sampler closed"
    assert len(sampler.samples) == 2, sampler.samples
    (first_at, first), (second_at, second) = sampler.samples
    assert first == (1980.0, 100.0, 0) and second == (1830.0, 690.0, 4) and second_at - first_at >= 0.25
    assert sampler.window(start, first_at)["sm_mhz"] == 1980.0
    period = clocks.PERIOD_MS / 1000
    assert sampler.window(first_at - 1, first_at - period / 2)["sm_mhz"] == 1980.0  # arrived within a period after
    assert sampler.window(first_at - 1, first_at - 1.5 * period) is None  # more than a period after: another span's
    late = sampler.window(second_at - 0.01, second_at + 1)
    assert late["sm_mhz"] == 1830.0 and late["power_capped"] == 1.0 and late["samples"] == 1
    assert sampler.window(second_at + 1, second_at + 2) is None


def test_without_nvidia_smi_the_sampler_samples_nothing(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    sampler = clocks.ClockSampler()
    assert sampler.window(0.0, time.time()) is None
    start = time.time()
    assert sampler.windows([(start, start)]) == [None] and time.time() - start < clocks.PERIOD_MS / 1000  # no wait
    sampler.close()


def test_windows_wait_for_the_sample_that_describes_their_last_period():
    """A window read at its own end would miss the sample that arrives up to a period later and
    describes the span's last period; ``windows`` waits for it (a review, 2026-12-04)."""
    script = "import time\nwhile True:\n    print('1980, 100.0, 0x0', flush=True)\n    time.sleep(0.01)"
    with clocks.ClockSampler(command=[sys.executable, "-c", script]) as sampler:
        while not sampler.samples:
            time.sleep(0.01)
        t0 = time.time()
        time.sleep(0.05)
        t1 = time.time()
        at_once = sampler.window(t0, t1)["samples"]
        (waited,) = sampler.windows([(t0, t1)])
        assert time.time() >= t1 + clocks.PERIOD_MS / 1000
        assert waited["samples"] > at_once, (waited, at_once)
