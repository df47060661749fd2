"""The GPUs' power, SM clock and clock-limit reasons over a benchmark's runs.

``nvidia-smi`` samples in the background (``-lms``); ``window(t0, t1)`` summarises the samples
of one run (``time.monotonic()`` bounds). Under a power limit the SM clock falls below its
maximum and every kernel slows with it, so a run's MFU (against the fixed dense peak) is given
beside ``mfu_at_clock``: the same FLOP/s against the peak at the clock the run had (Hopper:
4096 dense bf16 FLOP per SM per clock; the H200's 989 TFLOP/s is that at 1830 MHz).

Each sample carries nvidia-smi's own timestamp (wall clock, ms), turned into ``time.monotonic()``
time by the offset between the two clocks at start-up, so pipe buffering cannot shift it.
Without nvidia-smi (the CPU) ``GpuTelemetry.start`` gives None and nothing is sampled.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import threading
import time
from datetime import datetime
from statistics import fmean, median

DENSE_BF16_FLOP_PER_SM_CLOCK = {9: 4096}  # Hopper (SM 9.x): 132 SMs x 4096 x 1830 MHz = 989 TFLOP/s

# Newer drivers name the limit reasons ``clocks_event_reasons``; older ones ``clocks_throttle_reasons``.
REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown")
PREFIXES = ("clocks_event_reasons", "clocks_throttle_reasons")


def _fields(prefix: str) -> list[str]:
    return ["index", "timestamp", "power.draw", "clocks.sm", "temperature.gpu", *(f"{prefix}.{r}" for r in REASONS)]


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str, offset: float) -> tuple | None:
    """(gpu index, monotonic time, power W, SM MHz, temperature C, *reason active) from one CSV line
    of ``_fields``, or None for a line that is not one (a warning, a blank)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5 + len(REASONS) or not parts[0].isdigit():
        return None
    try:
        wall = datetime.strptime(parts[1], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    return (int(parts[0]), wall - offset, _num(parts[2]), _num(parts[3]), _num(parts[4]),
            *(p.lower() == "active" for p in parts[5:]))


def summarize(samples: list[tuple], t0: float, t1: float, max_sm_mhz: float | None = None,
              power_limit_w: float | None = None) -> dict | None:
    """The samples within [t0, t1] (all GPUs together): power and clock means, the share of
    samples with each clock-limit reason active. None when there are none."""
    inside = [s for s in samples if t0 <= s[1] <= t1]
    if not inside:
        return None
    power = [s[2] for s in inside if s[2] is not None]
    clock = [s[3] for s in inside if s[3] is not None]
    temp = [s[4] for s in inside if s[4] is not None]
    out = {"samples": len(inside), "gpus": len({s[0] for s in inside}),
           "power_w_mean": round(fmean(power), 1) if power else None,
           "power_w_median": round(median(power), 1) if power else None,
           "power_limit_w": power_limit_w,
           "sm_mhz_mean": round(fmean(clock), 1) if clock else None,
           "sm_mhz_median": median(clock) if clock else None,
           "sm_mhz_max": max_sm_mhz,
           "temperature_c_max": max(temp) if temp else None}
    for i, reason in enumerate(REASONS):
        out[f"{reason}_share"] = round(sum(s[5 + i] for s in inside) / len(inside), 3)
    return out


def mfu_at_clock(flop_per_s_per_gpu: float, sm_mhz: float | None, sms: int, major: int) -> float | None:
    """FLOP/s per GPU over the dense bf16 peak at ``sm_mhz`` (None where unknown)."""
    per_clock = DENSE_BF16_FLOP_PER_SM_CLOCK.get(major)
    if not sm_mhz or not per_clock:
        return None
    return flop_per_s_per_gpu / (sms * per_clock * sm_mhz * 1e6)


class GpuTelemetry:
    """nvidia-smi sampling GPUs ``indices`` every ``interval_ms`` until ``close()``."""

    def __init__(self, proc: subprocess.Popen, offset: float, static: dict[int, dict]) -> None:
        self.proc, self.offset, self.static = proc, offset, static
        self.samples: list[tuple] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, indices: list[int], interval_ms: int = 50, smi: str = "nvidia-smi") -> GpuTelemetry | None:
        exe = shutil.which(smi)
        if exe is None:
            return None
        ids = ",".join(map(str, indices))
        static: dict[int, dict] = {}
        for prefix in PREFIXES:  # the reasons' names this driver takes
            probe = subprocess.run([exe, f"--id={ids}", "--query-gpu=" + ",".join(_fields(prefix)),
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True)
            if probe.returncode == 0:
                break
        else:
            return None
        lim = subprocess.run([exe, f"--id={ids}", "--query-gpu=index,enforced.power.limit,clocks.max.sm",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        for line in lim.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].isdigit():
                static[int(parts[0])] = {"power_limit_w": _num(parts[1]), "sm_mhz_max": _num(parts[2])}
        offset = time.time() - time.monotonic()
        proc = subprocess.Popen([exe, f"--id={ids}", "--query-gpu=" + ",".join(_fields(prefix)),
                                 "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        tel = cls(proc, offset, static)
        atexit.register(tel.close)  # a benchmark that fails leaves no sampler running
        return tel

    def _read(self) -> None:
        for line in self.proc.stdout:
            s = parse_line(line, self.offset)
            if s is not None:
                with self._lock:
                    self.samples.append(s)

    def window(self, t0: float, t1: float) -> dict | None:
        """The summary of [t0, t1] (``time.monotonic()``), waiting a moment for its last samples."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with self._lock:
                if self.samples and self.samples[-1][1] >= t1:
                    break
            time.sleep(0.05)
        with self._lock:
            samples = list(self.samples)
        limits = [v["power_limit_w"] for v in self.static.values() if v.get("power_limit_w")]
        clocks = [v["sm_mhz_max"] for v in self.static.values() if v.get("sm_mhz_max")]
        return summarize(samples, t0, t1, max(clocks) if clocks else None, min(limits) if limits else None)

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
