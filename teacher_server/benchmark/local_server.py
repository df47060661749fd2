"""A server of the benchmark's own for ``--model`` / ``--shape``: ``teacher-server serve`` in a
child process on a free loopback port, stopped (SIGTERM, then SIGKILL) when the run ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(serve_args: list[str], log_path: str, ready_timeout_s: float = 1800.0) -> Iterator[str]:
    """Yield the base URL of ``teacher-server serve SERVE_ARGS`` once ``/health`` is 200; its
    output goes to ``log_path`` (named in the error when it does not start)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "teacher_server", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"teacher-server bench: the server exited with code {proc.returncode} before it "
                                 f"was ready; its log: {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"teacher-server bench: the server was not ready in {ready_timeout_s:.0f}s; "
                                 f"its log: {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM (the server drains, as under an orchestrator), then SIGKILL past ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, timeout_s: float, api_key: str | None = None) -> None:
    """Return once ``url``'s ``/health`` is 200; SystemExit naming the URL and what it answered
    when that has not happened within ``timeout_s`` (0: one try)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            r = httpx.get(url + "/health", headers=headers, timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise SystemExit(f"teacher-server bench: {url} is not ready ({last}); is the server running there? "
                             "(--wait-ready-s waits for one still loading)")
        time.sleep(1.0)
