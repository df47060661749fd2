"""Wider pipes between the front and its replica processes.

A request goes to its replica, and its scores come back, through an OS pipe (the replica's
inbox queue, its answer connection): ~0.8 MB each way for a W1f-shaped request (4,096 tokens,
3,072 rows of 64 candidates). Linux gives a pipe 64 KiB, so the receiving thread reads such a
message in a dozen reads, taking back the GIL after each; in a replica whose engine thread is
launching a step (Python, holding the GIL but for the interpreter's 5 ms switches), and in a
front whose event loop is reading uploads, each of those takes up to a switch interval.
Measured (``bench/bench_pipes.py``): 786 KB took ~65-75 ms to cross to a process with a thread
busy in Python, against ~12 ms through a pipe that holds it whole. So the pipes are widened to
``PIPE_BYTES`` (or the system's cap, ``/proc/sys/fs/pipe-max-size``: 1 MiB by default).
Elsewhere (not Linux, or past the user's pipe quota) they stay as the system makes them.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from pathlib import Path

log = logging.getLogger("teacher_server.replicas")

PIPE_BYTES = 4 << 20  # asked for each pipe; an unprivileged process gets at most the system's cap
_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


def system_cap() -> int | None:
    """The largest pipe an unprivileged process may ask for (None where not told)."""
    try:
        return int(_MAX_SIZE.read_text())
    except (OSError, ValueError):
        return None


def pipe_bytes(conn: Connection) -> int | None:
    """The capacity of the pipe under ``conn`` (None where it cannot be told)."""
    try:
        import fcntl

        return fcntl.fcntl(conn.fileno(), fcntl.F_GETPIPE_SZ)
    except (ImportError, AttributeError, OSError, ValueError):
        return None


def widen(conn: Connection | None, want: int = PIPE_BYTES) -> int | None:
    """Make the pipe under ``conn`` (either end) hold ``want`` bytes, or as many as the system
    allows; returns its capacity then, None where it is left as it was (no such call here, not
    a pipe, the user's pipe quota spent)."""
    if conn is None:
        return None
    try:
        import fcntl

        setsz = fcntl.F_SETPIPE_SZ
    except (ImportError, AttributeError):  # not Linux
        return None
    cap = system_cap()
    for size in dict.fromkeys((want, min(want, cap) if cap else want)):
        try:
            return fcntl.fcntl(conn.fileno(), setsz, size)
        except (OSError, ValueError):
            continue
    log.debug("pipe left at %s bytes: the system refused %d", pipe_bytes(conn), want)
    return None


def queue_writer(q: object) -> Connection | None:
    """The write end of a ``multiprocessing`` queue's pipe (None where the queue has none)."""
    conn = getattr(q, "_writer", None)
    return conn if isinstance(conn, Connection) else None
