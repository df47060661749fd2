"""``Replica``: the front's handle on one replica process: its queue (requests sent and not yet
answered, with their tokens: the load the router reads), and the thread that reads its
answers and notices when it exits.

Everything that touches ``pending`` and the counters runs on the server's event loop; the
reader thread only posts onto it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.context import SpawnContext

from teacher_server.config import Config
from teacher_server.engine.request import ScoreRequest
from teacher_server.replicas.messages import AddMsg, CancelMsg, FromReplica, LostMsg, ResultMsg, StopMsg
from teacher_server.replicas.pipes import queue_writer, widen
from teacher_server.replicas.preload import fork_server_stopped
from teacher_server.replicas.worker import run_replica

log = logging.getLogger("teacher_server.replicas")


class ReplicaLost(Exception):
    """The replica went away before answering; the request was not scored there."""


class Replica:
    """One replica process (``index`` 0..N-1, routed by ``name``, its index as a string).
    ``state``: starting, ready, down (exited or failed to start) or stopped (shut down)."""

    EXIT_WAIT_S = 5.0  # after its pipe closed, how long its exit status may take to be reported

    def __init__(self, index: int, ctx: SpawnContext, cfg: Config, factory: Callable[[Config], object],
                 devices: str | None) -> None:
        self.index, self.name = index, str(index)
        self.state = "starting"
        self.error: str | None = None
        self.requests = 0  # sent, not yet answered
        self.last_heard = time.monotonic()  # its last message (replicas send one at least every HEARTBEAT_S)
        self.tokens = 0  # their tokens: the load the router balances
        self.ready_at: float | None = None  # when it became ready (time.monotonic())
        self.started_at: float | None = None  # when its process was started
        self.start_timed_out = False  # killed for not becoming ready in time (once)
        self.down_at: float | None = None  # when its exit was seen
        self._pending: dict[int, tuple[ScoreRequest, asyncio.Future]] = {}
        self._inbox: mp.Queue = ctx.Queue()
        self._inbox.cancel_join_thread()  # never block exit on a replica that stopped reading
        reader, writer = ctx.Pipe(duplex=False)
        # a request's arrays in, its scores out, each in one read or a few (``pipes``)
        widen(queue_writer(self._inbox))
        widen(reader)
        self._reader = reader
        self.process = ctx.Process(target=run_replica, args=(index, cfg, factory, devices, self._inbox, writer),
                                   name=f"teacher-replica-{index}")
        self._writer = writer

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self, on_message: Callable[[Replica, FromReplica | None], None]) -> None:
        """Start the process and the reader thread; ``on_message(self, msg)`` is called from
        that thread for every message, then once with None when the process has exited. Where
        the fork server is stopped nothing starts: the start reads as a failure at once (the
        pool's restarts and give-up rule follow) rather than block the event loop on it."""
        self.started_at = time.monotonic()
        if (why := fork_server_stopped()) is not None:
            self.error = why
            on_message(self, None)
            return
        self.process.start()
        self._writer.close()  # the child holds the only write end: its exit reads as EOF here
        threading.Thread(target=self._read, args=(on_message,), name=f"teacher-replica{self.index}-out",
                         daemon=True).start()

    def _read(self, on_message: Callable[[Replica, FromReplica | None], None]) -> None:
        while True:
            try:
                msg = self._reader.recv()
            except (EOFError, OSError):
                break
            self.last_heard = time.monotonic()
            on_message(self, msg)
        # Wait for the exit without reaping it: only the loop thread reaps (``exitcode``,
        # ``join``); two threads waiting on one process race for its status. A stopped fork
        # server never reports the exit of a process it forked: the closed pipe then stands for it.
        while not wait([self.process.sentinel], timeout=self.EXIT_WAIT_S):
            if (stopped := fork_server_stopped()) is not None:
                log.warning("replica %d closed its pipe; its exit cannot be reported (%s): taken as down",
                            self.index, stopped)
                break
        on_message(self, None)

    def reap(self) -> None:
        """Collect the exit status (its pipe has closed: the status follows at once), unless the
        fork server is stopped: then it cannot come, and the process is left out of the
        interpreter's exit, which would wait on it for ever."""
        if self.process.pid is None:  # never started (``start`` found the fork server stopped)
            return
        self.process.join(0 if fork_server_stopped() else 1.0)
        self._forget_if_unreported()

    def _forget_if_unreported(self) -> None:
        """Leave a process whose exit was not reported (a stopped fork server) out of the
        interpreter's exit, which would wait on it for ever."""
        if self.process.exitcode is None:
            getattr(mp.process, "_children", set()).discard(self.process)

    # --- on the event loop -------------------------------------------------------------
    def submit(self, req: ScoreRequest) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._pending[req.uid] = (req, fut)
        self.requests += 1
        self.tokens += req.length
        self._inbox.put(AddMsg(req))
        return fut

    def cancel(self, uid: int) -> None:
        if self._take(uid) is not None:
            self._inbox.put(CancelMsg(uid))

    def _take(self, uid: int) -> asyncio.Future | None:
        item = self._pending.pop(uid, None)
        if item is None:
            return None
        req, fut = item
        self.requests -= 1
        self.tokens -= req.length
        return fut

    def answer(self, msg: ResultMsg | LostMsg) -> None:
        uid = msg.res.uid if isinstance(msg, ResultMsg) else msg.uid
        fut = self._take(uid)
        if fut is None or fut.done():
            return
        if isinstance(msg, ResultMsg):
            fut.set_result(msg.res)
        else:
            fut.set_exception(ReplicaLost(f"replica {self.index} lost the request"))

    def went_down(self, why: str) -> None:
        """The process has exited: nothing it held will be answered."""
        self.state, self.error, self.down_at = "down", why, time.monotonic()
        for uid in list(self._pending):
            fut = self._take(uid)
            if fut is not None and not fut.done():
                fut.set_exception(ReplicaLost(f"replica {self.index} went down ({why})"))

    def stop(self) -> None:
        """Ask the process to exit (its engine shuts down); ``join`` waits for it."""
        if self.process.is_alive():
            self._inbox.put(StopMsg())

    def kill(self, why: str) -> None:
        """End a process that no longer answers (its threads' stacks first, where it still runs:
        a hang rather than a stop); its exit then reads as any other (``went_down``)."""
        self.error = why
        self._dump_and_kill()

    def _dump_and_kill(self) -> None:
        try:
            os.kill(self.process.pid, signal.SIGUSR1)  # the replica's faulthandler prints its threads' stacks
            time.sleep(0.5)
            self.process.kill()
        except (ProcessLookupError, TypeError):  # exited meanwhile (or never started)
            pass

    def join(self, timeout: float) -> None:
        if self.process.pid is None:  # never started (``start`` found the fork server stopped)
            return
        stopped = fork_server_stopped()  # (no exit is reported while it is)
        self.process.join(0 if stopped else timeout)
        if self.process.is_alive():
            log.warning("replica %d: %s; killing it (its threads' stacks follow)", self.index,
                        stopped or "it did not exit within the shutdown's deadline")
            self._dump_and_kill()
            self.process.join(0 if stopped else 5)  # (its exit cannot be reported while the fork server is stopped)
        self._forget_if_unreported()
