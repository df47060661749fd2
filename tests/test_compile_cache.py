"""The compile cache directory (compiled kernels and autotuning kept across restarts) and the
start-up's per-phase log line."""

from __future__ import annotations

import logging
import os

import pytest

from teacher_server.compile_cache import cache_summary, use_compile_cache
from teacher_server.config import Config
from teacher_server.engine.startup_phases import StartupPhases

VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TEACHER_SERVER_EXT_DIR",
        "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TEACHER_SERVER_PLAN_DIR")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return monkeypatch


def test_an_explicit_directory_holds_every_cache(clean_env, tmp_path) -> None:
    root = use_compile_cache(str(tmp_path / "cc"))
    assert root == tmp_path / "cc" and root.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"  # Triton times every config again without it
    assert os.environ["TEACHER_SERVER_EXT_DIR"] == str(root / "ext")
    assert os.environ["TEACHER_SERVER_PLAN_DIR"] == str(root / "cudnn_fe")  # the cudnn_fe backend's graphs


def test_the_default_is_under_the_user_cache_and_keeps_the_kernel_library_where_it_was(clean_env, tmp_path) -> None:
    root = use_compile_cache(None)
    assert root == tmp_path / "xdg" / "teacher-server" / "compile"
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton") and "TEACHER_SERVER_EXT_DIR" not in os.environ


def test_a_variable_set_by_the_user_wins_and_off_leaves_everything(clean_env, tmp_path) -> None:
    clean_env.setenv("TRITON_CACHE_DIR", "/image/triton")
    use_compile_cache(str(tmp_path / "cc"))
    assert os.environ["TRITON_CACHE_DIR"] == "/image/triton"
    for v in VARS:
        clean_env.delenv(v, raising=False)
    assert use_compile_cache("off") is None and not any(v in os.environ for v in VARS)
    assert Config(compile_cache_dir="off").compile_cache_dir == "off"


def test_an_unwritable_directory_warns_and_starts_anyway(clean_env, tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        assert use_compile_cache(str(blocker / "cc")) is None
    assert "not writable" in caplog.text and "TRITON_CACHE_DIR" not in os.environ


def test_summary_counts_what_is_kept(tmp_path) -> None:
    assert cache_summary(None) == "off"
    assert cache_summary(tmp_path).endswith(": 0 files, 0 MB")
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "k.cubin").write_bytes(b"x" * 3_000_000)
    assert cache_summary(tmp_path).endswith(": 1 files, 3 MB")


def test_phases_count_nested_work_once(monkeypatch) -> None:
    clock = iter([0.0, 2.0, 10.0, 10.5])
    monkeypatch.setattr("teacher_server.engine.startup_phases.time.perf_counter", lambda: next(clock))
    p = StartupPhases()
    p.done("weights")  # 0 -> 2
    p.add({"attention plans": 3.0, "compile": 4.0})  # inside the next phase
    p.done("KV pool")  # 2 -> 10, of which 7 already counted
    p.done("warm-up requests")
    assert p.seconds == {"weights": 2.0, "attention plans": 3.0, "compile": 4.0, "KV pool": 1.0,
                         "warm-up requests": 0.5}
    assert p.line() == "10.5s (weights 2.0s, attention plans 3.0s, compile 4.0s, KV pool 1.0s, warm-up requests 0.5s)"


def test_the_engine_logs_its_start_up_phases(tmp_path, caplog) -> None:
    from teacher_server.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="teacher_server"):
        e = Engine(Config(device="cpu", demo_model_dir=str(tmp_path / "m"), max_model_len=256, num_kv_blocks=64,
                          warm_up=False))
    assert {"model files", "weights", "attention checks", "KV pool"} <= set(e.startup_phases)
    assert "start-up took" in caplog.text and "weights" in caplog.text


def test_the_warm_up_logs_each_batch(tmp_path, caplog) -> None:
    from teacher_server.engine.engine import Engine
    from teacher_server.engine.warm_up import WARM_UP_BATCHES, warm_up_plan

    assert len(WARM_UP_BATCHES) == len(warm_up_plan(100, 64, 32, 4))
    with caplog.at_level(logging.INFO, logger="teacher_server"):
        eng = Engine(Config(device="cpu", demo_model_dir=str(tmp_path / "m"), max_model_len=64, num_kv_blocks=64,
                            max_num_batched_tokens=32, warm_up=True))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:"))
    assert all(name in line for name in WARM_UP_BATCHES), line
    # a start-up phase of its own (the log line leaves out phases under 0.05 s: the demo model's may be)
    assert "warm-up requests" in eng.startup_phases


PROBE = """
import sys
import torch
from teacher_server.compile_cache import use_compile_cache
use_compile_cache(sys.argv[1])  # after `import torch`, as the engine does
from torch._dynamo.utils import counters
f = torch.compile(lambda x: torch.nn.functional.silu(x) * x + 1)
f(torch.randn(256, 256, device="cuda"))
print(dict(counters["inductor"]))
"""


@pytest.mark.gpu
def test_a_second_process_loads_what_the_first_compiled(tmp_path) -> None:
    """torch.compile in a fresh process misses the cache, in the next one hits it (inductor reads
    the directory set after torch was imported). On the CPU the same probe took 34.6 s, then 3.3 s."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env["PYTHONPATH"] = str(root)
    runs = [subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "cc")], capture_output=True, text=True,
                           env=env, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert "fxgraph_cache_miss" in runs[0].stdout and "fxgraph_cache_hit" in runs[1].stdout, [r.stdout for r in runs]
    assert any((tmp_path / "cc" / "triton").rglob("*.cubin")), "Triton's kernels are in the cache directory"
