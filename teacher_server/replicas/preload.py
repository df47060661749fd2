"""The engine's process started from an interpreter that has already imported it.

A spawned replica process imports torch and the engine (seconds) only after the server
process has imported its own (seconds more) and started the app. ``start_preloading``,
called by ``teacher-server serve`` as soon as its configuration is read, starts
multiprocessing's fork server at once, and the fork server imports the engine while the
server process imports the app; the replicas are then forked from it with everything
imported (``process_context``).

What a fresh spawned interpreter guarantees still holds: the fork server is a new
interpreter of its own (not a fork of the server process, with its threads and state), and it
never touches CUDA (importing torch and the engine does not initialise it: a test checks), so
each replica initialises CUDA itself, as torch's forked DataLoader workers do. Environment set
in the server process after ``start_preloading`` does not reach the replicas (nothing sets any
there: the compile cache's variables are set by the engine, in its own process)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.context import BaseContext

from teacher_server.config import Config

log = logging.getLogger("teacher_server.replicas")

# what a replica process imports before it builds its engine (the target, its config, the engine)
PRELOAD = ("teacher_server.replicas.fork_server",)
_preloading = False
_owner: int | None = None  # the process that started the fork server (its parent)
NVIDIA_NODE = "/dev/nvidiactl"  # there on a Linux host (or container) with the NVIDIA driver and a GPU given


def may_need_engine_process(cfg: Config) -> bool:
    """Could ``cfg`` run its engine(s) in processes of their own (``pool.engine_elsewhere``)?
    Decided without torch (device auto: an NVIDIA driver's device node, some GPU visible); a
    wrong guess costs an idle process, or the preloading only."""
    if cfg.data_parallel_size > 1 or cfg.engine_process:
        return True
    if cfg.engine_process is not None or cfg.ranks_per_replica() != 1 or cfg.device == "cpu":
        return False
    if cfg.device == "cuda":
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return os.path.exists(NVIDIA_NODE) and (visible is None or visible.strip() not in ("", "-1"))


def start_preloading() -> bool:
    """Start the fork server, importing ``PRELOAD`` (returns at once; False where the platform
    has no fork server: replicas are spawned)."""
    global _preloading
    if _preloading:
        return True
    if "forkserver" not in mp.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    try:
        forkserver.ensure_running()
    except OSError as e:  # (no Unix sockets here): spawned, as without it
        log.info("replica processes are spawned (no fork server: %s)", e)
        return False
    _preloading = True
    global _owner
    _owner = os.getpid()
    atexit.register(end_stopped_fork_server)
    return True


def process_context() -> BaseContext:
    """The context replica processes start from: the fork server where ``start_preloading``
    started it, else spawn (a fresh interpreter)."""
    return mp.get_context("forkserver" if _preloading else "spawn")


def fork_server_stopped() -> str | None:
    """Why replicas cannot be started now, or None: the fork server they are forked from is
    stopped (SIGSTOP). Starting one would then block on it for as long as it stays so, and the
    exit of a replica it forked is never reported. (A dead one is started again by the next
    start, which reaps it.)"""
    if not _preloading:
        return None
    pid = _fork_server_pid()
    state = process_state(pid) if pid else None  # (None: gone and reaped, started again; or no /proc)
    return f"the fork server (pid {pid}) that replicas start from is stopped" if state in ("T", "t") else None


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (R, S, T stopped, Z a zombie, ...); None when
    there is no such process (or no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _fork_server_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def end_stopped_fork_server() -> None:
    """At exit (and before a hard exit): kill the fork server if it is stopped. A running one
    ends by itself when this process's end closes its pipe; a stopped one never reads that, and
    would stay behind (holding its memory) after the service exits. Only the process that
    started it does this, and it waits at most a second for the exit (a traced one may not
    report it)."""
    if os.getpid() != _owner or fork_server_stopped() is None:
        return
    pid = _fork_server_pid()
    try:
        os.kill(pid, signal.SIGKILL)
        log.warning("killed the stopped fork server (pid %d)", pid)
        deadline = time.monotonic() + 1.0
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
    except (OSError, TypeError):  # gone already, or not ours to reap
        pass
