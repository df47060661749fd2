"""Inside a replica process: one ``AsyncEngine`` (its engine thread, admission, deadlines,
cancellation, exactly as the single-engine server runs it) fed by the front's messages.

The process sees only its own GPUs (``CUDA_VISIBLE_DEVICES`` is set before torch touches
CUDA), so the engine inside is unchanged: ``cuda:0`` is this replica's GPU. On the CPU each
replica takes its share of the cores. It exits 0 when told to stop, 3 when the engine cannot
start or dies, and when the front process is gone.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection

from teacher_server.config import Config
from teacher_server.engine.request import ErrorKind, ScoreResult
from teacher_server.heap import freeze_start_up_heap
from teacher_server.replicas.messages import (
    AddMsg,
    CancelMsg,
    FromReplica,
    LostMsg,
    ReadyMsg,
    ReplicaInfo,
    ResultMsg,
    StartFailedMsg,
    StatsMsg,
    StopMsg,
)

log = logging.getLogger("teacher_server.replicas")
STATS_INTERVAL_S = 0.25  # how often a changed engine snapshot is sent to the front (metrics)
HEARTBEAT_S = 1.0  # the snapshot is sent at least this often, changed or not: the front sees the process is there
# The interpreter's switch interval here: while the engine thread launches a step (Python, ~0.1 s a
# step on a GPU) the threads that take the front's requests in and send answers out wait for the
# GIL at each read; at Python's 5 ms a W1f request took ~12 ms to arrive through a widened pipe,
# at 1 ms ~4 ms (``bench/bench_pipes.py``). Threads that want nothing cost the engine nothing.
SWITCH_INTERVAL_S = 0.001


def replica_devices(index: int, per_replica: int, visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of replica ``index``: its ``per_replica`` GPUs (one, or a
    TP group) out of the ones this host process may use (``visible``, default all)."""
    if visible is not None and visible.strip():
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    need = (index + 1) * per_replica
    if need > len(ids):
        raise RuntimeError(f"replica {index} needs GPUs {index * per_replica}..{need - 1} but only "
                           f"{len(ids)} are visible ({','.join(ids) or 'none'})")
    return ",".join(ids[index * per_replica:need])


def run_replica(index: int, cfg: Config, factory: Callable[[Config], object], devices: str | None,
                inbox: mp.Queue, outbox: Connection) -> None:
    """The replica process's target. ``devices``: its CUDA_VISIBLE_DEVICES (None on CPU)."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before any CUDA call of this process
    from teacher_server.logging_setup import setup_logging

    setup_logging(cfg.log_level, cfg.log_json)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack
    # The front stops a replica through its inbox, and a replica exits when the front is gone: a
    # signal to the whole process group (Ctrl-C, a service manager's SIGTERM) is the front's to
    # handle (it drains), not a replica's to die of with the requests it holds.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if devices is None:
        import torch

        # N CPU replicas share the cores instead of each starting one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.data_parallel_size))
    one = cfg.model_copy(update={"data_parallel_size": 1})
    code = asyncio.run(_serve(index, one, factory, inbox, _Sender(outbox)))
    os._exit(code)  # skip interpreter teardown: the engine thread may still hold the GPU


class _Sender:
    """The pipe to the front, shared by the loop and the stats thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: FromReplica) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):  # the front is gone; the reader notices
                pass


def answer(res: ScoreResult, engine_alive: bool) -> ResultMsg | LostMsg:
    """What the front gets for a request's result: ``LostMsg`` when this replica's engine died
    under it or before it (its INTERNAL or UNAVAILABLE failure is the replica's, not the
    request's: the front sends it to another replica), else the result."""
    if res.error_kind in (ErrorKind.INTERNAL, ErrorKind.UNAVAILABLE) and not engine_alive:
        return LostMsg(res.uid)
    return ResultMsg(res)


class Tasks(dict):
    """The requests this replica is scoring (uid -> task). Each leaves as its task ends, by a
    done callback: a task cancelled before its first step (the front's cancel read in the loop
    turn its request arrived in) never runs its coroutine, so no cleanup inside it would run,
    and its request's arrays would stay here for the process's life."""

    def start(self, uid: int, coro: Coroutine) -> None:
        self[uid] = task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda _: self.pop(uid, None))


async def _serve(index: int, cfg: Config, factory: Callable[[Config], object], inbox: mp.Queue,
                 out: _Sender) -> int:
    from teacher_server.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
    from teacher_server.engine.request import ScoreRequest

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[BaseException] = []

    def on_fatal(e: BaseException) -> None:  # engine thread
        fatal.append(e)
        loop.call_soon_threadsafe(stop.set)

    tasks = Tasks()
    ae: AsyncEngine | None = None  # set once built; the front's messages are read from the start

    async def one(req: ScoreRequest) -> None:
        try:
            res = await ae.score(req)
        except (EngineOverloaded, EngineUnavailable) as e:
            res = ScoreResult.failed(req, e.kind, str(e))
        out.send(answer(res, ae.alive))

    def handle(msg: object) -> None:  # on the loop
        match msg:
            case AddMsg(req=req):
                tasks.start(req.uid, one(req))
            case CancelMsg(uid=uid):
                t = tasks.get(uid)
                if t is not None:
                    t.cancel()
            case _:
                if ae is None:  # stopped, or the front gone, while the engine loads: nothing to drain
                    log.info("replica %d: stopped while loading", index)
                    logging.shutdown()
                    os._exit(0)  # the load runs on in its thread; the process ends now
                stop.set()

    def post(msg: object) -> bool:
        try:
            loop.call_soon_threadsafe(handle, msg)
            return True
        except RuntimeError:  # the loop has closed
            return False

    def read() -> None:  # the front's messages, onto the loop
        while True:
            try:
                msg = inbox.get()
            except (EOFError, OSError):
                msg = StopMsg()
            if not post(msg) or isinstance(msg, StopMsg):
                return

    def watch_front() -> None:  # a gone front stops the replica
        # Apart from read(): a front killed while it sent a message leaves the rest of it
        # unwritten, and read() waits for it for good (this process holds the queue's write
        # end too, so no end of file comes).
        parent = mp.parent_process()
        if parent is None:
            return
        parent.join()
        log.warning("replica %d: the front process is gone; stopping", index)
        post(StopMsg())

    def report() -> None:  # the engine's snapshot, when it changed (the front's metrics), and as a heartbeat
        last, sent = None, 0.0
        while not stop.is_set():
            try:
                s = engine.stats()
                if s != last or time.monotonic() - sent >= HEARTBEAT_S:
                    out.send(StatsMsg(s))
                    last, sent = s, time.monotonic()
            except Exception:  # a failed snapshot must not end the heartbeats (a healthy replica killed as hung)
                log.exception("replica %d: stats snapshot failed", index)
            stop_wait.wait(STATS_INTERVAL_S)

    threading.Thread(target=read, name=f"teacher-replica{index}-in", daemon=True).start()
    threading.Thread(target=watch_front, name=f"teacher-replica{index}-front", daemon=True).start()
    try:
        # The front already applies the queue limits per replica; these only back them up.
        ae = await AsyncEngine.build(lambda: factory(cfg), cfg.max_queue_requests, cfg.max_queue_tokens,
                                     on_fatal=on_fatal, stall_timeout_s=cfg.stall_timeout_s)
    except BaseException as e:
        log.critical("replica %d: engine failed to start: %s: %s", index, type(e).__name__, e)
        out.send(StartFailedMsg(f"{type(e).__name__}: {e}"))
        return 3
    engine = ae.engine
    freeze_start_up_heap(f"replica {index}")
    out.send(ReadyMsg(ReplicaInfo(engine.served_model_name, str(engine.model_dir), engine.max_model_len,
                                  engine.spec.vocab_size)))
    stop_wait = threading.Event()
    threading.Thread(target=report, name=f"teacher-replica{index}-stats", daemon=True).start()
    await stop.wait()
    stop_wait.set()
    if fatal:  # nothing to drain: the front sends what this replica held elsewhere once it has exited;
        log.critical("replica %d: engine failed (%s); exiting", index, fatal[0])  # an engine thread stuck
        engine.kill_workers()  # in a step would hold a shutdown (and the GPU) for its join timeouts
        return 3
    for t in list(tasks.values()):
        t.cancel()
    await asyncio.to_thread(ae.shutdown)
    return 0
