"""The engine's process forked from a fork server that imported it while the server process
imported the app (``replicas.preload``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from teacher_server.config import Config
from teacher_server.replicas.preload import may_need_engine_process

ROOT = Path(__file__).resolve().parents[1]


def test_preloading_where_an_engine_may_run_in_a_process_of_its_own(monkeypatch, tmp_path) -> None:
    from teacher_server.replicas import preload

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(preload, "NVIDIA_NODE", str(tmp_path / "nvidiactl"))
    assert not may_need_engine_process(Config())  # device auto without a driver: the engine on a thread
    (tmp_path / "nvidiactl").write_text("")
    assert may_need_engine_process(Config())  # device auto, one GPU engine: a process of its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not may_need_engine_process(Config())  # no GPU visible
    assert may_need_engine_process(Config(device="cuda"))
    assert may_need_engine_process(Config(device="cpu", data_parallel_size=2))
    assert may_need_engine_process(Config(device="cpu", engine_process=True))
    assert not may_need_engine_process(Config(device="cpu"))  # the engine on a thread of the server
    assert not may_need_engine_process(Config(device="cuda", engine_process=False))
    assert not may_need_engine_process(Config(device="cuda", tensor_parallel_size=2))


def test_a_process_forked_from_the_fork_server_finds_the_engine_imported() -> None:
    """... with SIGTERM ignored (a group's SIGTERM is the front's to drain) and CUDA untouched;
    the server process itself neither imports the fork server's module nor ignores SIGTERM."""
    code = """
import json, signal, sys
sys.path.insert(0, "tests")
from teacher_server.replicas import preload
assert preload.process_context().get_start_method() == "spawn"
assert preload.start_preloading()
ctx = preload.process_context()
assert ctx.get_start_method() == "forkserver"
import preload_probe
q = ctx.SimpleQueue()
p = ctx.Process(target=preload_probe.probe, args=(q,))
p.start()
got = q.get()
p.join(60)
got["exit"] = p.exitcode
got["front imports it"] = "teacher_server.replicas.fork_server" in sys.modules
got["front ignores sigterm"] = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
print(json.dumps(got))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"engine imported": True, "worker imported": True, "sigterm ignored": True,
                   "cuda initialized": False, "exit": 0, "front imports it": False, "front ignores sigterm": False}
