"""Tensor-parallel worker processes: ranks 1..N-1 of a model split over N devices of one host
(or, with ``nnodes`` > 1, ranks 1..G-1 of the leader's G, the rest on other hosts: ``remote_ranks``).

Design: rank 0 runs in the engine's own process (its ``ModelRunner``), so scheduling, the HTTP
server, result assembly and rank 0's share of the forward stay where they are today. Each other
rank is a spawned process holding its shard and its KV pool; it loops: receive a step's host
plan -> run the same forward and scoring -> take part in the collectives. The plan
(``HostStep``'s numpy arrays, the request bookkeeping stripped) is pickled once and sent down one
pipe per worker, once per step, before rank 0 starts that step: the workers never see requests,
and nothing per layer crosses processes except the all-reduces. Every rank's results are the
same after the vocab-parallel combine; only rank 0's are used. Under pipeline parallel the ranks
are pipeline x tensor parallel: a worker of a stage before the last runs its layers and sends the
residual stream on (``layers.pipeline``); the plans go to every rank at once, up to a step per
stage ahead of rank 0 (a rank of the last stage), each read whole on a worker's thread (``_read_plans``).

Start-up and faults go over the same pipes, never over a collective, so nothing blocks on a rank
that is gone: each worker says it is loaded and how many KV blocks (and linear-state slots) fit
its memory; the engine takes the minimum (an all-reduce MIN done by hand) and sends it back. A
watchdog thread waits on the workers' process sentinels: a worker that dies or raises (it exits
non-zero) is noticed at once, even while rank 0 sits in a collective, and reported to the failure
hook (the server's: unhealthy, then exit). Workers exit when the engine's process is gone (a
thread polls the parent pid) and ignore SIGINT and SIGTERM (the engine stops them).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from teacher_server.config import Config
from teacher_server.engine.host_step import HostStep
from teacher_server.engine.process_group import init_group, make_store, rank_device, set_nccl_env
from teacher_server.engine.wire import PlanReader
from teacher_server.heap import freeze_start_up_heap

if TYPE_CHECKING:

    from teacher_server.engine.rank_setup import MemoryPlan
    from teacher_server.engine.remote_ranks import RemoteRanks

log = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # loading a large model's shards


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or is gone: the engine cannot go on."""


class TPWorkers:
    """The worker processes of ranks 1..size-1, seen from the engine (rank 0)."""

    def __init__(self, cfg: Config, model_dir: Path, device: torch.device, size: int) -> None:
        set_nccl_env()
        local = size // cfg.nnodes  # ranks on this host; the others are the worker nodes' (node-major)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            on = f" / nnodes={cfg.nnodes}" if cfg.nnodes > 1 else ""
            raise RuntimeError(f"tensor_parallel_size x pipeline_parallel_size{on} = {local} ranks need {local} GPUs, "
                               f"this host has {torch.cuda.device_count()} visible")
        self.size, self.device = size, device
        self.store = make_store(0, size)  # held while the group lives
        self.remote: RemoteRanks | None = None
        if cfg.nnodes > 1:
            from teacher_server.engine.remote_ranks import RemoteRanks

            self.remote = RemoteRanks(cfg, size, self.store.port, model_dir)
        self._closing = self._closed = False  # (closing: a kill or a close under way)
        self._reaped: set[int | None] = set()  # pids the watchdog has reaped (never signalled again)
        self._hook: Callable[[BaseException], None] | None = None
        self.failure: str | None = None
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, local):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"teacher-tp{rank}", daemon=True,
                            args=(rank, size, self.store.port, cfg.model_dump(), str(model_dir), str(device), child,
                                  os.getpid()))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        threading.Thread(target=self._watch, name="teacher-tp-watchdog", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing joins (never ends: they ignore its SIGTERM)

    # --- start-up ------------------------------------------------------------------------
    def _recv(self, i: int, what: str, timeout: float) -> tuple:
        conn = self.conns[i]
        p = self.procs[i] if i < len(self.procs) else None  # None: a rank of another node
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if conn.poll(0.2):
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = ("error", "its pipe closed")
                if msg[0] == "error":
                    raise TensorParallelError(f"tensor-parallel rank {i + 1} failed {what}: {msg[1]}")
                return msg
            if p is not None and not p.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {i + 1} exited (code {p.exitcode}) {what}")
            if p is None and self.failure is not None:
                raise TensorParallelError(f"{self.failure} (rank {i + 1} {what})")
        raise TensorParallelError(f"tensor-parallel rank {i + 1} did not answer {what} within {timeout:.0f}s")

    def wait_joined(self) -> None:
        """Every worker is up and about to join the process group (the other nodes' too)."""
        for i in range(len(self.procs)):
            self._recv(i, "at start-up", 600.0)
        if self.remote is not None:
            self.conns += self.remote.wait_all(START_TIMEOUT_S, self._check_failure)
            for i in range(len(self.procs), len(self.conns)):
                self._recv(i, "at start-up", 600.0)

    def _check_failure(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def form_group(self, join: Callable[[], None]) -> None:
        """Run rank 0's side of forming the process group (``join``) while watching the
        workers: one that dies before the group forms (a GPU failing NCCL's start) would leave
        rank 0 in the rendezvous until its timeout (10 minutes); this raises within a second
        instead (the joining thread is a daemon, left to that timeout)."""
        failed: list[BaseException] = []

        def run() -> None:
            try:
                join()
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=run, name="teacher-tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            if t.is_alive() and self.failure is not None:
                raise TensorParallelError(f"{self.failure} while the process group formed")
        if failed:
            raise failed[0]

    def agree_memory(self, own: MemoryPlan) -> MemoryPlan:
        """The KV blocks, linear-state slots and token budget every rank can hold (the minimum
        of each over the ranks; of the slots, over the ranks that keep state: a pipeline stage
        of attention layers only keeps none); sent to all."""
        from teacher_server.engine.rank_setup import MemoryPlan

        plans = [own] + [MemoryPlan(*self._recv(i, "while loading its shard", START_TIMEOUT_S)[1])
                         for i in range(len(self.conns))]
        blocks, slots, budget = zip(*plans)
        n = MemoryPlan(min(blocks), min((s for s in slots if s), default=0), min(budget))
        for c in self.conns:
            c.send(("blocks", tuple(n)))
        for i in range(len(self.conns)):
            self._recv(i, "while building its KV pool", 600.0)
        log.info("tensor/pipeline parallel: %d ranks, (KV blocks, state slots, token budget) per rank %s -> %s",
                 self.size, [tuple(p) for p in plans], tuple(n))
        return n

    # --- steps ---------------------------------------------------------------------------
    def send(self, hs: HostStep) -> None:
        """Hand a step's plan to every worker (before rank 0 runs it)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        data = pickle.dumps(replace(hs, scoring=replace(hs.scoring, spans=[])), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except OSError as e:
            raise TensorParallelError(f"a tensor-parallel rank is gone: {e}") from None

    # --- faults and shutdown ---------------------------------------------------------------
    def on_failure(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook`` (from the watchdog thread) when a worker dies."""
        self._hook = hook
        if self.failure is not None:
            hook(TensorParallelError(self.failure))

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while (alive or self.remote is not None) and not self._closing:
            nodes = self.remote.watched() if self.remote is not None else {}
            try:
                ready = wait([*alive, *nodes], timeout=1.0)
            except (OSError, ValueError):  # a node connection closed by close() meanwhile
                return
            if self._closing:
                return
            exited = [s for s in ready if s in alive]
            if exited:
                p = alive.pop(exited[0])
                p.join(1.0)  # reaped, so its exit code is known
                self._reaped.add(p.pid)
                failure = f"tensor-parallel worker {p.name} exited (code {p.exitcode})"
            else:  # a worker node's heartbeat, error or end (or nothing: its silence is timed)
                failure = self.remote.check([c for c in ready if c in nodes]) if self.remote is not None else None
            if failure is None or self._closing:
                continue
            self.failure = failure
            log.critical("%s; stopping the other ranks", self.failure)
            self._kill()
            if self.remote is not None:
                self.remote.close(stop=False)  # the worker nodes end theirs
            if self._hook is not None:
                self._hook(TensorParallelError(self.failure))
            return

    def kill(self) -> None:
        """SIGKILL every worker still running (from any thread: no reaping here)."""
        self._closing = True
        for p in self.procs:
            if p.pid is not None and p.pid not in self._reaped:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker: ask, wait, then kill; leave the process group."""
        atexit.unregister(self.close)
        if self._closed:
            return
        self._closed = self._closing = True
        if self.remote is not None:  # before their ranks are asked: a node then takes their exits as clean
            try:
                self.remote.tell(("stop",))
            except (OSError, ValueError):
                pass
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        for p in self.procs:
            p.join(5.0)
        if self.remote is not None:
            self.remote.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _orphan_guard(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # the engine's process is gone: nobody will stop this one


def _read_plans(conn: Connection) -> queue.SimpleQueue:
    """The step plans as they arrive, each in one read (``wire``), on a thread of their own into a
    queue (an EOFError or OSError where the connection ends). Read only between steps, a plan
    larger than the pipe's buffer would block the engine's write while this rank, in the step
    before, waits on the engine's rank in a collective or a stage hand-off (pipeline parallel)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    reader = PlanReader(conn)

    def read() -> None:
        try:
            while True:
                data = reader.recv_bytes()
                q.put(data)
                if not data:
                    return
        except (EOFError, OSError) as e:
            q.put(e)

    threading.Thread(target=read, name="teacher-tp-plans", daemon=True).start()
    return q


def worker_main(rank: int, size: int, port: int, cfg_dict: dict, model_dir: str, device_name: str,
                conn: Connection, parent: int, host: str = "127.0.0.1", local: int | None = None) -> None:
    """A worker's life: join, load its shard, agree on the KV size, then run steps. ``conn``: a
    pipe to the engine, or a worker node's rank's control connection to the leader (``host``,
    the store's address; ``local``, its GPU index on its host)."""
    set_nccl_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the group's signals are the engine's process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_orphan_guard, args=(parent,), daemon=True).start()
    logging.basicConfig(level=cfg_dict.get("log_level", "info").upper(),
                        format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        from teacher_server.engine.pacer import Unpaced
        from teacher_server.engine.rank_setup import (
            MemoryPlan,
            load_rank,
            make_runner,
            model_spec,
            placement,
            plan_memory,
            resolve_dtype,
        )

        cfg = Config(**cfg_dict)
        device = rank_device(torch.device(device_name), rank if local is None else local)
        conn.send(("joining",))
        init_group(device, rank, size, make_store(rank, size, port, host), local)
        spec = model_spec(cfg, model_dir)
        tp, stage = placement(cfg, spec, rank)
        max_len = cfg.max_model_len or spec.max_position_embeddings
        model, attn = load_rank(cfg, Path(model_dir), spec, device, resolve_dtype(cfg.dtype, spec, device), tp,
                                stage=stage)
        conn.send(("loaded", tuple(plan_memory(cfg, spec, model.cache_layout(), device, max_len, tp))))
        _, agreed = conn.recv()
        runner = make_runner(cfg, model, attn, MemoryPlan(*agreed), max_len, device)
        conn.send(("built",))
        freeze_start_up_heap(f"tensor-parallel rank {rank}")
        plans = _read_plans(conn)
        while True:
            data = plans.get()
            if isinstance(data, BaseException):
                raise EOFError from data
            if not data:  # the engine stops us
                break
            runner.execute(pickle.loads(data), Unpaced())
    except EOFError:
        code = 1  # the engine's end of the pipe closed: it is gone
    except BaseException as e:
        traceback.print_exc()
        code = 1
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"[:2000]))
        except OSError:
            pass
    os._exit(code)  # skip interpreter teardown (process-group destructors) after a failure
