"""bench/gpu_clocks.py: nvidia-smi's CSV read per GPU, summarised per level, sampled in a
thread that a fake nvidia-smi (a script printing canned rows) drives here."""

from __future__ import annotations

import sys
import time

from pdunit.bench.gpu_clocks import GpuSampler, Sample, parse, summarize


def test_parse_reads_each_gpu_row_and_skips_what_the_driver_does_not_report():
    text = "0, 1980, 612.34, 61\n1, 1755, 700.00, 70\n2, [N/A], 10.0, 30\nnot a row\n"
    assert parse(text) == [Sample(0, 1980.0, 612.34, 61.0), Sample(1, 1755.0, 700.0, 70.0)]


def test_summary_is_the_lowest_clock_mean_power_and_hottest_gpu():
    got = summarize([Sample(0, 1980, 600, 60), Sample(1, 1500, 700, 72), Sample(0, 1900, 650, 65)])
    assert got == {"gpu_sm_mhz_min": 1500, "gpu_power_w_mean": 650.0, "gpu_temp_c_max": 72}
    assert summarize([]) == {}


def test_the_sampler_keeps_only_its_gpus_until_stopped(tmp_path):
    fake = tmp_path / "smi.py"
    fake.write_text("print('0, 1980, 600, 60')\nprint('1, 1200, 690, 80')\n")
    sampler = GpuSampler([1], period_s=0.01, command=(sys.executable, str(fake))).start()
    deadline = time.monotonic() + 30
    while len(sampler.samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    got = sampler.stop()
    assert len(sampler.samples) >= 2 and {s.index for s in sampler.samples} == {1}
    assert got == {"gpu_sm_mhz_min": 1200.0, "gpu_power_w_mean": 690.0, "gpu_temp_c_max": 80.0}
    n = len(sampler.samples)
    time.sleep(0.1)
    assert len(sampler.samples) == n  # stopped: no more samples


def test_a_missing_nvidia_smi_gives_no_figures_not_wrong_ones(tmp_path):
    sampler = GpuSampler([0], period_s=0.01, command=(str(tmp_path / "no-such-smi"),)).start()
    assert sampler.stop() == {}
