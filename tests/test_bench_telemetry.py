"""bench/gpu_telemetry.py: nvidia-smi's samples parsed, windowed and summarised (a stand-in
nvidia-smi script here; the real one runs in the GPU benchmarks)."""

from __future__ import annotations

import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_telemetry import GpuTelemetry, mfu_at_clock, parse_line, summarize


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_parse_line_reads_a_sample_and_skips_other_lines():
    now = time.time()
    s = parse_line(f"1, {stamp(now)}, 690.12, 1500, 61, Active, Not Active, Not Active", 0.0)
    assert s[0] == 1 and s[1] == pytest.approx(now, abs=2e-3)
    assert s[2:] == (690.12, 1500.0, 61.0, True, False, False)
    na = parse_line(f"0, {stamp(now)}, [N/A], [N/A], 40, Not Active, Not Active, Not Active", 0.0)
    assert na[2] is None and na[3] is None
    assert parse_line("", 0.0) is None
    assert parse_line("Failed to query: unknown field", 0.0) is None
    assert parse_line("0, not a time, 1, 2, 3, Active, Active, Active", 0.0) is None


def test_summarize_keeps_the_window_only():
    samples = [(0, float(t), 600.0 + t, 1400.0 + t, 50.0, t >= 2, False, False) for t in range(6)]
    w = summarize(samples, 1.0, 4.0, max_sm_mhz=1980.0, power_limit_w=700.0)
    assert w["samples"] == 4 and w["gpus"] == 1
    assert w["power_w_mean"] == pytest.approx(602.5) and w["sm_mhz_mean"] == pytest.approx(1402.5)
    assert w["sw_power_cap_share"] == 0.75 and w["hw_slowdown_share"] == 0.0
    assert w["power_limit_w"] == 700.0 and w["sm_mhz_max"] == 1980.0
    assert summarize(samples, 10.0, 11.0) is None


def test_mfu_at_clock_is_the_dense_peak_at_that_clock():
    # the H200's 989.4 TFLOP/s: 132 SMs x 4096 FLOP per clock at 1830 MHz
    assert mfu_at_clock(989.4e12, 1830.0, 132, 9) == pytest.approx(1.0, rel=1e-3)
    assert mfu_at_clock(500e12, 915.0, 132, 9) == pytest.approx(2 * 500 / 989.4, rel=1e-3)
    assert mfu_at_clock(500e12, None, 132, 9) is None
    assert mfu_at_clock(500e12, 1500.0, 108, 8) is None  # no figure for other architectures


def test_telemetry_samples_a_stand_in_nvidia_smi(tmp_path):
    """An old driver's field names (the new ones refused), the static query, a sampling loop."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import sys, time
        from datetime import datetime
        args = " ".join(sys.argv[1:])
        if "clocks_event_reasons" in args:
            print("Field is not a valid field to query", file=sys.stderr); sys.exit(2)
        if "enforced.power.limit" in args:
            print("0, 700.00, 1980"); sys.exit(0)
        loop = "-lms=" in args
        while True:
            t = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            print(f"0, {t}, 650.5, 1500, 60, Active, Not Active, Not Active", flush=True)
            if not loop:
                break
            time.sleep(0.02)
        """))
    smi.chmod(0o755)
    t0 = time.monotonic()
    tel = GpuTelemetry.start([0], interval_ms=20, smi=str(smi))
    assert tel is not None
    try:
        deadline = t0 + 30
        while len(tel.samples) < 3 and time.monotonic() < deadline:  # a loaded machine starts it slowly
            time.sleep(0.05)
        w = tel.window(t0, time.monotonic())
    finally:
        tel.close()
    assert w is not None and w["samples"] >= 3
    assert w["power_w_mean"] == 650.5 and w["sm_mhz_mean"] == 1500.0 and w["sw_power_cap_share"] == 1.0
    assert w["power_limit_w"] == 700.0 and w["sm_mhz_max"] == 1980.0
    assert GpuTelemetry.start([0], smi=str(tmp_path / "absent")) is None
