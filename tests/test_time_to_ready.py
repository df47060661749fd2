"""bench/time_to_ready.py on the CPU with the demo model: two starts, each timed to /health
ready, the server's start-up phases read from its log, JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import time_to_ready  # noqa: E402


def test_the_start_up_line_is_parsed() -> None:
    log = ("INFO teacher_server.engine.engine: start-up took 41.5s (weights 12.0s, attention plans 5.1s, "
           "compiles and autotuning 20.4s, warm-up requests 4.0s); compile cache /c: 0 files, 0 MB "
           "before, 812 files, 95 MB after\n")
    got = time_to_ready.parse_phases(log)
    assert got["engine_s"] == 41.5 and got["phases"]["compiles and autotuning"] == 20.4
    assert got["phases"]["weights"] == 12.0 and got["compile_cache"].endswith("95 MB after")
    assert time_to_ready.parse_phases("no such line") == {}


def test_the_time_outside_the_engine_is_read_from_the_log() -> None:
    launched = time_to_ready.stamp("2026-12-04 16:00:00,000 INFO x: y")
    log = ("2026-12-04 16:00:04,250 INFO teacher_server.server: starting the engine of m in a process of its own\n"
           "2026-12-04 16:00:36,750 INFO teacher_server.engine.engine: start-up took 27.0s (weights 5.0s); "
           "compile cache /c: 1 files, 0 MB before, 1 files, 0 MB after\n")
    got = time_to_ready.outside_engine(log, launched, launched + 37.5)
    assert got == {"front": 4.25, "engine process": 5.5, "after the engine": 0.75}
    assert time_to_ready.outside_engine("no lines", launched, launched + 1) == {}


def test_two_starts_on_cpu_write_json(tmp_path) -> None:
    out = tmp_path / "ttr.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "time_to_ready.py"), "--model-size", "demo",
                        "--device", "cpu", "--workdir", str(tmp_path / "w"), "--out", str(out),
                        "--server-args", "--max-model-len 256 --num-kv-blocks 32 --engine-process"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [s["name"] for s in res["starts"]] == ["first start (empty cache)", "restart 1 (cache kept)"]
    for s in res["starts"]:
        assert 0 < s["ready_s"] < 300 and s["engine_s"] >= 0 and "compile_cache" in s
    assert res["device"] == "cpu" and res["restart_within_target"] is None and "restart_saved_s" in res
    for s in res["starts"]:  # the seconds outside the engine, each part found in the log
        parts = s["outside_engine"]
        assert set(parts) == {"front", "engine process", "after the engine"}, parts
        assert 0 < parts["front"] < s["ready_s"] and abs(parts["engine process"]) < s["ready_s"]
    assert (tmp_path / "ttr_server_1.log").read_text().count("start-up took") == 1
    assert "ready in" in r.stdout
