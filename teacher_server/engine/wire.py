"""A step's plan off a tensor-parallel rank's connection in one blocking read.

The engine sends each worker a step's plan (``HostStep``: for a W1f step of eight requests
~6.6 MB, mostly candidate ids) with ``Connection.send_bytes``, and the engine's thread waits in
that send until the worker has the bytes. ``Connection.recv_bytes`` reads a socket as it fills,
in pieces of its buffer (~200 KiB), taking back the GIL after each; in a worker whose main
thread is launching its step (Python, holding the GIL but for the interpreter's switches) each
piece waits up to a switch interval. ``PlanReader`` reads the same wire format
(``multiprocessing.connection``'s length header, then the bytes) with ``MSG_WAITALL``: one read
that returns with the whole message, the GIL released throughout. Measured
(``bench/bench_pipes.py``): a W1f plan read in pieces kept the sender waiting ~158 ms for a busy
rank (~8 ms for an idle one); read whole, ~8 ms (~3 ms). A connection that is not a socket is
read as ``Connection.recv_bytes`` reads it.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from multiprocessing.connection import Connection


class PlanReader:
    """Whole messages from ``conn`` (its other end writes them with ``send_bytes``); used by one
    thread, after any other reading of ``conn`` has ended (it reads the same socket)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sock: socket.socket | None = None
        try:
            fd = conn.fileno()
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                self.sock = socket.socket(fileno=os.dup(fd))  # (its own descriptor: closed with it)
                self.sock.setblocking(True)
        except (OSError, ValueError):
            self.sock = None

    def recv_bytes(self) -> bytes | bytearray:
        """The next message (empty where the sender sent b""); EOFError where the connection
        ended, OSError where it failed."""
        if self.sock is None:
            return self.conn.recv_bytes()
        (size,) = struct.unpack("!i", self._exactly(4))
        if size == -1:  # (a message of 2 GiB or more: its length follows in 8 bytes)
            (size,) = struct.unpack("!Q", self._exactly(8))
        return self._exactly(size)

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:  # (MSG_WAITALL returns early only on a signal, an error or the end)
            k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise EOFError("connection closed")
            got += k
        return buf

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
