"""bench.common.GpuTelemetry: nvidia-smi lines parsed, samples summarised over the marked windows only."""

import sys
import time

from bench.common import SMI_FIELDS, GpuTelemetry, parse_smi_line


def test_parse_smi_line():
    assert parse_smi_line("1860, 1980, 692.15, 700.00\n") == (1860.0, 1980.0, 692.15, 700.0)
    assert parse_smi_line("1980, 1980, [N/A], 700.00") is None  # a field the driver does not report
    assert parse_smi_line(", ".join(SMI_FIELDS)) is None  # a header
    assert parse_smi_line("1980, 700.00") is None


# A stand-in for `nvidia-smi --loop-ms`: one line every 10 ms, the clock counting up from 1000 MHz
# and the power alternating between 650 W and 690 W against a 700 W limit (690 >= 95 %).
_FAKE = ("import sys, time\n"
         "i = 0\n"
         "while True:\n"
         "    print(f'{1000 + i}, 1980, {650 + 40 * (i % 2)}.0, 700.00', flush=True)\n"
         "    i += 1\n"
         "    time.sleep(0.01)\n")


def _wait(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the sampler produced nothing"
        time.sleep(0.01)


def test_summary_reads_only_the_samples_inside_windows():
    with GpuTelemetry(command=[sys.executable, "-c", _FAKE]) as tel:
        _wait(lambda: len(tel.samples) >= 5)  # samples before the window: not counted
        with tel.window():
            n0 = len(tel.samples)
            _wait(lambda: len(tel.samples) >= n0 + 8)
        n1 = len(tel.samples)
        _wait(lambda: len(tel.samples) >= n1 + 5)  # and after it: not counted either
    inside = [v for t, v in tel.samples if tel.windows[0][0] <= t <= tel.windows[0][1]]
    s = tel.summary()
    assert s["gpu_samples"] == len(inside) >= 7
    clocks = sorted(v[0] for v in inside)
    assert clocks[0] > 1000  # the first samples, read before the window opened, are left out
    k = len(clocks)
    assert s["gpu_clock_mhz"] == (clocks[k // 2] if k % 2 else (clocks[k // 2 - 1] + clocks[k // 2]) / 2)
    assert s["gpu_max_clock_mhz"] == 1980.0 and s["gpu_power_limit_w"] == 700.0
    high = sum(v[2] == 690.0 for v in inside)
    assert s["gpu_power_capped_share"] == round(high / k, 3) and 0 < high < k
    assert tel._proc is None  # the sampler is stopped on exit
    assert tel.take() == s and tel.take()["gpu_samples"] == 0  # take() starts a new set of windows


def test_without_a_sampler_every_figure_is_none():
    with GpuTelemetry(command=None) as tel:
        with tel.window():
            time.sleep(0.05)
        assert tel._proc is None and len(tel.windows) == 1 and tel.windows[0][1] - tel.windows[0][0] >= 0.05
    s = tel.take()
    assert s["gpu_samples"] == 0 and not tel.samples and not tel.windows
    assert all(s[k] is None for k in ("gpu_clock_mhz", "gpu_max_clock_mhz", "gpu_power_w", "gpu_power_limit_w",
                                      "gpu_power_capped_share"))
