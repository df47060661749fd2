"""Shared fixtures: tiny checkpoints of every family, and live servers on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference import make_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> directory, made lazily on first use."""
    root = tmp_path_factory.mktemp("ckpt")

    class Lazy(dict):
        def __missing__(self, fam: str) -> Path:
            p = make_checkpoint(fam, root / fam)
            self[fam] = p
            return p

    return Lazy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f}s"
        time.sleep(0.02)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until a server process answers /health with 200 (fails if it exits or times out)."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.1)


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a background thread."""

    def __init__(self, cfg, port: int | None = None, drain_timeout: float | None = None, **app_kw) -> None:
        """``drain_timeout``: the command line's server (``DrainingServer``: SIGTERM drains, see
        ``handle_exit``) with that drain, instead of uvicorn's own."""
        import uvicorn

        from teacher_server.server.app import create_app
        from teacher_server.server.http import uvicorn_config
        from teacher_server.server.lifecycle import DrainingServer

        self.cfg = cfg
        self.app = create_app(cfg, **app_kw)
        # Bound here, before the server starts (uvicorn binds only after the app's start-up), so
        # no other process can take the port meanwhile; a given port: a server restarted where
        # clients expect it.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port or 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, cfg, host="127.0.0.1", port=self.port, lifespan="on")
        self.server = uvicorn.Server(config) if drain_timeout is None else \
            DrainingServer(config, self.app, drain_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        """Start, and return once /health says the engine is ready (the port answers before)."""
        self.thread.start()
        deadline = time.time() + 180
        while time.time() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("server failed to start")
            if self.server.started:
                auth = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
                try:
                    status = httpx.get(self.url + "/health", headers=auth, timeout=5).json().get("status")
                except httpx.HTTPError:
                    status = None
                if status == "ready":
                    return self
                if status == "failed":
                    self.__exit__()
                    raise RuntimeError("engine failed to start")
            time.sleep(0.05)
        raise RuntimeError("server did not start in time")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """The built-in demo model served on CPU (its own cache dir)."""
    from teacher_server.config import Config

    cfg = Config(demo_model_dir=str(tmp_path_factory.mktemp("demo") / "m"), device="cpu",
                 max_num_batched_tokens=512, num_kv_blocks=4096, max_model_len=8192, max_logprobs=64)
    with LiveServer(cfg) as s:
        yield s


@pytest.fixture(scope="session")
def qwen3_server(checkpoints):
    """A tiny Qwen3 checkpoint served with a small budget, so long sequences are chunked."""
    from teacher_server.config import Config

    cfg = Config(model=str(checkpoints["qwen3"]), device="cpu", max_num_batched_tokens=96, block_size=8,
                 num_kv_blocks=512, max_model_len=1024, max_logprobs=64)
    with LiveServer(cfg) as s:
        yield s
