"""``ReplicaPool``: N replica processes behind the surface the server uses of ``AsyncEngine``
(``score``, ``alive``, ``accepting``, ``in_flight``, ``drain``, ``shutdown``).

Each request goes to one replica chosen by ``teacher_server.routing`` (prefix affinity, or
least outstanding tokens), among those with room in their own queue (``max_queue_requests``
and ``max_queue_tokens`` hold per replica). A replica fails alone: one that dies, stops
answering (no heartbeat for ``heartbeat_timeout_s``: killed) or stalls (its engine completes no
step for ``stall_timeout_s``: it exits) hands back what it held unanswered, and each of those
requests is sent to another replica: scoring is idempotent and a lost request was not scored,
so no row is lost or doubled. The replica is then restarted after ``replica_restart_backoff_s``
(doubled after each restart that fails or dies again within ``STABLE_S``) while the others
serve; ``capacity`` says how many serve (``/health`` reports the pool degraded, and fails only
when none does).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from teacher_server.config import Config
from teacher_server.engine.async_engine import EngineOverloaded, EngineUnavailable
from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult
from teacher_server.engine.stats import EngineStats
from teacher_server.replicas.messages import (
    FromReplica,
    LostMsg,
    ReadyMsg,
    ReplicaInfo,
    ResultMsg,
    StartFailedMsg,
    StatsMsg,
)
from teacher_server.replicas.preload import process_context
from teacher_server.replicas.replica import Replica, ReplicaLost
from teacher_server.replicas.worker import replica_devices
from teacher_server.routing import Router

log = logging.getLogger("teacher_server.replicas")


# A request is sent to another replica when its replica goes down under it, once: when the
# second goes down too, the request itself (one that crashes the GPU) is the likelier cause, and
# sending it on would take every replica down in turn. It fails with a 500 (not retried).
MAX_REPLICAS_LOST = 1


def _serving(r: Replica) -> bool:
    """Ready and not being killed (``kill`` sets ``error`` before the exit is seen: from then on
    nothing is routed to it, and it does not count as serving)."""
    return r.state == "ready" and r.error is None


class ReplicaPool:
    """Start with ``start()`` (on the event loop), then ``await ready()``."""

    STABLE_S = 300.0  # a replica that served this long before it went down is restarted after the first backoff
    MAX_BACKOFF_DOUBLINGS = 6  # the restart delay is at most 64 x replica_restart_backoff_s
    GIVE_UP_AFTER = 5  # quick failures in a row, none serving: on_give_up

    def __init__(self, cfg: Config, factory: Callable[[Config], object],
                 on_stats: Callable[[int, EngineStats], None] | None = None,
                 on_down: Callable[[int, str], None] | None = None, gpus_per_replica: int | None = None,
                 on_up: Callable[[int, bool], None] | None = None,
                 on_give_up: Callable[[str], None] | None = None) -> None:
        """``on_down(index, why)`` when a replica goes down (it is restarted); ``on_up(index,
        restarted)`` when one is ready, ``restarted`` for one started again; ``on_give_up(why)``
        when a replica has failed ``GIVE_UP_AFTER`` times in a row, each soon after starting, and
        none serves (a broken GPU: the service exits for its orchestrator instead of retrying)."""
        self.cfg = cfg
        self.max_queue_requests, self.max_queue_tokens = cfg.max_queue_requests, cfg.max_queue_tokens
        self.router = Router(cfg.routing, cfg.block_size, cfg.routing_spill_tokens)
        self.on_stats, self.on_down, self.on_up, self.on_give_up = on_stats, on_down, on_up, on_give_up
        self.silent_s = cfg.heartbeat_timeout_s  # a ready replica silent this long (it beats each second) is killed
        self._ctx = process_context()  # no inherited CUDA state or threads (spawned, or forked from the preloader)
        self._factory = factory
        # A replica is a whole engine: one GPU, or a tensor-parallel group of them (its own
        # worker processes start inside the replica process, on the GPUs it was given).
        if gpus_per_replica is None:
            gpus_per_replica = cfg.ranks_per_replica() if hasattr(cfg, "ranks_per_replica") else 1
        gpu = uses_gpu(cfg)
        gpus = getattr(cfg, "gpus", None)  # a teacher's own GPUs, else this process's
        visible = (",".join(gpus) if gpus else _visible_devices()) if gpu else None
        self._devices = [replica_devices(i, gpus_per_replica, visible) if gpu else None
                         for i in range(cfg.data_parallel_size)]
        self.replicas = [self._make(i) for i in range(cfg.data_parallel_size)]
        self.restarts = [0] * cfg.data_parallel_size  # times each replica was started again
        self._quick_failures = [0] * cfg.data_parallel_size  # restarts in a row that did not serve STABLE_S
        self.info: ReplicaInfo | None = None
        self.accepting = True
        self.retried = 0  # requests sent again after their replica went down
        self._scoring = 0  # score() calls not yet returned (a request failing over is between replicas)
        self._stopping = False
        self._started: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        for r in self.replicas:
            r.start(self._post)
        threading.Thread(target=self._watch_silence, name="teacher-replica-heartbeat", daemon=True).start()

    def _make(self, index: int) -> Replica:
        return Replica(index, self._ctx, self.cfg, self._factory, self._devices[index])

    def _watch_silence(self) -> None:
        """A ready replica that sends nothing for ``silent_s`` (its process stopped or hung: no
        heartbeat, so no exit either) is killed: its requests then fail over and it is
        restarted, as when a replica dies."""
        last = time.monotonic()
        tick = min(1.0, self.silent_s / 4)
        while not self._stopping:
            time.sleep(tick)
            now = time.monotonic()
            if now - last > max(self.silent_s / 2, 2 * tick + 1.0):  # this process was paused too (a frozen
                for r in list(self.replicas):  # container): the replicas' heartbeats are in the pipes, not missing
                    r.last_heard = max(r.last_heard, now)
            last = now
            limit = self.cfg.replica_start_timeout_s
            for r in list(self.replicas):
                if (limit and r.state == "starting" and not r.start_timed_out and r.started_at is not None
                        and now - r.started_at > limit):  # a load or warm-up that hangs: a failed start
                    log.critical("replica %d (pid %s) not ready %.0fs after it started (replica_start_timeout_s): "
                                 "killing it", r.index, r.pid, now - r.started_at)
                    r.start_timed_out = True
                    r.kill(f"not ready within replica_start_timeout_s={limit:g}s")
                    continue
                # (not is_alive(): it reaps the process, which only the loop thread may)
                if r.state == "ready" and r.error is None and now - r.last_heard > self.silent_s:
                    log.critical("replica %d (pid %s) sent nothing for %.0fs (stopped or hung): killing it",
                                 r.index, r.pid, now - r.last_heard)
                    r.kill(f"no heartbeat for {now - r.last_heard:.0f}s")

    async def ready(self) -> ReplicaInfo:
        """Wait until every replica is ready; raise when one fails to start (all are stopped)."""
        assert self._started is not None, "start() first"
        try:
            await self._started
        except BaseException:
            self.shutdown()
            raise
        assert self.info is not None
        return self.info

    @property
    def alive(self) -> bool:
        """Some replica can serve (requests are admitted); ``fatal_error`` says which cannot."""
        return any(_serving(r) for r in self.replicas)

    @property
    def capacity(self) -> tuple[int, int]:
        """(replicas serving, replicas)."""
        return sum(_serving(r) for r in self.replicas), len(self.replicas)

    @property
    def fatal_error(self) -> str | None:
        """What is not serving and why: replicas down, and those restarting after going down."""
        down = [f"replica {r.index} down: {r.error}" + (" (restarting)" if r.state == "starting" else "")
                for r in self.replicas if r.state != "ready" and (r.state == "down" or r.error)]
        down += [f"replica {r.index} being stopped: {r.error}" for r in self.replicas if r.state == "ready" and r.error]
        return "; ".join(down) or None

    @property
    def pids(self) -> list[int | None]:
        """The replicas' process ids, by index."""
        return [r.pid for r in self.replicas]

    @property
    def in_flight(self) -> int:
        """Requests not yet answered: every waiting ``score`` call, including one whose replica
        went down and that is being sent to another (no replica holds it then), and any request
        a replica still holds after its waiter left (its abort on the way)."""
        return max(self._scoring, sum(r.requests for r in self.replicas))

    def stop_accepting(self) -> None:
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        """Wait until in-flight requests finish (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica (their engines shut down) and wait for the processes."""
        self._stopping, deadline = True, time.monotonic() + timeout  # (one deadline for them all)
        for r in self.replicas:
            r.stop()
        for r in self.replicas:
            if r.process.pid is not None:
                r.join(max(0.0, deadline - time.monotonic()))
            if r.state != "down":
                r.state = "stopped"

    # --- requests ----------------------------------------------------------------------
    async def score(self, req: ScoreRequest) -> ScoreResult:
        """Route, queue on that replica and wait; sent again to another replica when the
        first goes down before answering. Cancelling the waiter aborts it there."""
        if not self.accepting:
            raise EngineUnavailable("server is shutting down")
        self._scoring += 1
        try:
            return await self._score(req)
        finally:
            self._scoring -= 1

    async def _score(self, req: ScoreRequest) -> ScoreResult:
        lo, hi = req.logit_range()
        key = self.router.key(req.token_ids, lo if hi > lo else 0, req.cache_salt)
        tried: set[str] = set()
        full: set[str] = set()  # replicas that refused it with a full queue (their count ran ahead of ours)
        while True:
            live = [r for r in self.replicas if _serving(r) and r.name not in tried]
            if not live:
                raise EngineUnavailable(self.fatal_error or "no replica can serve")
            room = [r for r in live if r.requests < self.max_queue_requests
                    and r.tokens + req.length <= self.max_queue_tokens and r.name not in full]
            if not room:
                raise EngineOverloaded(f"queue full on every replica ({sum(r.requests for r in live)} requests, "
                                       f"{sum(r.tokens for r in live)} tokens)")
            name = self.router.pick(key, {r.name: r.tokens for r in room})
            rep = self.replicas[int(name)]
            fut = rep.submit(req)
            try:
                res = await fut
                # A replica still holding a request the front has let go (cancelled, its abort
                # not yet there) may find its queue full: another replica, or a 429 as from the front.
                if res.error_kind != ErrorKind.OVERLOADED:
                    return res
                full.add(name)
            except ReplicaLost as e:
                tried.add(name)
                if len(tried) > MAX_REPLICAS_LOST:  # more likely what brings replicas down than bad luck
                    log.error("request %s: %s, the %d replica lost under it; not sent again",
                              req.request_id[:100], e, len(tried))
                    return ScoreResult.failed(req, ErrorKind.INTERNAL, f"inference failed: {len(tried)} replicas "
                                              f"went down while scoring it")
                log.warning("request %s: %s; sending it to another replica", req.request_id[:100], e)
                self.retried += 1
            except asyncio.CancelledError:
                rep.cancel(req.uid)
                raise

    # --- replica messages (reader threads -> the loop) ---------------------------------
    def _post(self, rep: Replica, msg: FromReplica | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_message, rep, msg)
        except RuntimeError:  # the loop has closed: the app is gone
            pass

    def _on_message(self, rep: Replica, msg: FromReplica | None) -> None:
        match msg:
            case ResultMsg() | LostMsg():
                rep.answer(msg)
            case StatsMsg(stats=s):
                if self.on_stats is not None:
                    self.on_stats(rep.index, s)
            case ReadyMsg(info=info):
                if rep is not self.replicas[rep.index] or self._stopping:
                    return
                restarted = rep.error is not None
                rep.state, rep.error, rep.ready_at, self.info = "ready", None, time.monotonic(), self.info or info
                log.info("replica %d ready (pid %s)%s", rep.index, rep.pid, " again" if restarted else "")
                if all(r.state == "ready" for r in self.replicas) and not self._started.done():
                    self._started.set_result(info)
                if self._started.done() and self.on_up is not None:
                    self.on_up(rep.index, restarted)
            case StartFailedMsg(error=err):
                rep.error = err
                if not self._started.done():
                    self._started.set_exception(RuntimeError(f"replica {rep.index} failed to start: {err}"))
            case None:  # the process has exited
                self._exited(rep)

    def _exited(self, rep: Replica) -> None:
        rep.reap()
        code = rep.process.exitcode
        if self._stopping or rep.state == "stopped":
            rep.state = "stopped"
            rep.went_down("shut down")
            rep.state = "stopped"
            return
        why = rep.error or f"process exited with code {code}"
        served_s = time.monotonic() - rep.ready_at if rep.ready_at is not None else 0.0
        rep.went_down(why)  # its requests fail over (their waiters route them again)
        log.critical("replica %d (pid %s) went down: %s", rep.index, rep.pid, why)
        if not self._started.done():
            self._started.set_exception(RuntimeError(f"replica {rep.index} failed to start: {why}"))
            return
        if self.on_down is not None:
            self.on_down(rep.index, why)
        i = rep.index
        self._quick_failures[i] = 0 if served_s >= self.STABLE_S else self._quick_failures[i] + 1
        if self.gives_up(i):
            self._stopping = True  # once: another replica's exit now reads as the shutdown's
            log.critical("replica %d failed %d times in a row, none serving: giving up", i, self._quick_failures[i])
            self.on_give_up(f"replica {i} failed {self._quick_failures[i]} times in a row, none serving: {why}")
            return
        delay = self.cfg.replica_restart_backoff_s * 2 ** min(max(self._quick_failures[i] - 1, 0),
                                                                self.MAX_BACKOFF_DOUBLINGS)
        log.warning("replica %d restarts in %.1fs; %d of %d replicas serve meanwhile", i, delay,
                    self.capacity[0], len(self.replicas))
        self._loop.call_later(delay, self._restart, rep)

    def gives_up(self, i: int) -> bool:
        """Whether replica ``i``'s failures end the pool (see ``on_give_up``)."""
        return (self.on_give_up is not None and self._quick_failures[i] >= self.GIVE_UP_AFTER
                and self.capacity[0] == 0)

    def _restart(self, old: Replica) -> None:
        """Start replica ``old.index`` again (a new process), unless the pool is stopping."""
        if self._stopping or self.replicas[old.index] is not old:
            return
        rep = self._make(old.index)
        rep.error = old.error  # why it is starting again (until it is ready)
        self.replicas[old.index] = rep
        self.restarts[old.index] += 1
        rep.start(self._post)


def engine_elsewhere(cfg: Config) -> bool:
    """Whether the engines of ``cfg`` run in processes of their own (replicas, or one engine
    with ``engine_process``), not on a thread of the server process. ``engine_process`` None:
    a process of its own for one engine on one GPU."""
    if cfg.data_parallel_size > 1 or cfg.engine_process:
        return True
    if cfg.engine_process is None:
        return cfg.ranks_per_replica() == 1 and uses_gpu(cfg)
    return False


def uses_gpu(cfg: Config) -> bool:
    """Whether the engine of ``cfg`` runs on CUDA (device cuda, or auto with a GPU present)."""
    if cfg.device == "cpu":
        return False
    import torch

    return cfg.device == "cuda" or torch.cuda.is_available()


def _visible_devices() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")
