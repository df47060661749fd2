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


def test_two_starts_on_cpu_write_json(tmp_path) -> None:
    out = tmp_path / "ttr.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "time_to_ready.py"), "--model-size", "demo",
                        "--device", "cpu", "--workdir", str(tmp_path / "w"), "--out", str(out),
                        "--server-args", "--max-model-len 256 --num-kv-blocks 32"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [s["name"] for s in res["starts"]] == ["first start (empty cache)", "restart 1 (cache kept)"]
    for s in res["starts"]:
        assert 0 < s["ready_s"] < 300 and s["engine_s"] >= 0 and "compile_cache" in s
    assert res["device"] == "cpu" and res["restart_within_target"] is None and "restart_saved_s" in res
    assert "ready in" in r.stdout
