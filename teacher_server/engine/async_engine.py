"""AsyncEngine: runs the Engine in one dedicated thread and exposes ``await score(req)``.

The engine is best built in that same thread (``AsyncEngine.build``): per-thread GPU
state made at start-up, such as cuDNN's execution-plan cache that the attention warm-up
fills, is then the state the steps use.

The event loop never runs GPU work. Requests and cancellations cross into the engine
thread as typed messages through a queue; results come back through
``loop.call_soon_threadsafe``. Admission control (bounded queue of requests and tokens)
happens here, at the edge. Requests are keyed by ``ScoreRequest.uid``: callers may use
the same ``request_id``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult

log = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The queue is full (requests or tokens); the client should retry later."""

    kind = ErrorKind.OVERLOADED


class EngineUnavailable(Exception):
    """The engine is draining for shutdown or has died."""

    kind = ErrorKind.UNAVAILABLE


class EngineStalled(RuntimeError):
    """The engine completed no step for ``stall_timeout_s`` while it held work (a hung GPU,
    kernel or tensor-parallel worker): it is failed as if it had died."""


@dataclass
class _Pending:
    req: ScoreRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


# --- messages to the engine thread ---------------------------------------------------------
@dataclass
class AddMsg:
    """Admit a request (already counted against the queue limits)."""

    pending: _Pending


@dataclass
class CancelMsg:
    """Its waiter was cancelled: abort the request, free its KV."""

    pending: _Pending


@dataclass
class ExitMsg:
    """Wake the thread to stop (``shutdown``)."""


Msg = AddMsg | CancelMsg | ExitMsg


class AsyncEngine:
    def __init__(self, engine: Engine | None, max_queue_requests: int, max_queue_tokens: int,
                 on_step: Callable[[Engine, list[ScoreResult]], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 factory: Callable[[], Engine] | None = None, stall_timeout_s: float | None = None) -> None:
        """Give either an engine, or a ``factory`` that the engine thread calls first (see
        ``build``). ``stall_timeout_s``: fail the engine (``EngineStalled``) when it completes
        no step for this long while it holds work; None: never."""
        if (engine is None) == (factory is None):
            raise ValueError("give an engine or a factory")
        self.engine = engine
        self._factory = factory
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.max_queue_requests = max_queue_requests
        self.max_queue_tokens = max_queue_tokens
        self.on_step = on_step
        self.on_fatal = on_fatal
        self._inbox: queue.SimpleQueue[Msg] = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}  # by ScoreRequest.uid; engine-thread owned after admission
        self._lock = threading.Lock()
        self._queued_requests = 0  # admitted and not finished (guarded by _lock)
        self._queued_tokens = 0
        self._stop = threading.Event()
        self.accepting = True
        self.alive = True
        self.fatal_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="teacher-engine", daemon=True)
        self.stall_timeout_s = stall_timeout_s
        self._progress_at = time.monotonic()  # the engine thread's last turn that ended (a step done, or idle)

    # --- lifecycle ---------------------------------------------------------------------
    @classmethod
    async def build(cls, factory: Callable[[], Engine], *args, **kw) -> AsyncEngine:  # noqa: ANN002, ANN003
        """Start the engine thread, build the engine in it and return once it is built
        (raising what the factory raised)."""
        ae = cls(None, *args, factory=factory, **kw)
        ae.start()
        while not ae._built.is_set():  # polled: a thread waiting on it (to_thread's pool threads are no
            await asyncio.sleep(0.05)  # daemons) would hold the interpreter's exit until the load ends
        if ae._build_error is not None:
            ae._thread.join(timeout=5)
            raise ae._build_error
        return ae

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        self.accepting = False

    @property
    def capacity(self) -> tuple[int, int]:
        """(engines serving, engines): the replica pool's surface, for one engine."""
        return (1 if self.alive and self.fatal_error is None else 0), 1

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._queued_requests

    async def drain(self, timeout: float) -> bool:
        """Wait until in-flight requests finish (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(ExitMsg())
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._thread.is_alive() and self.engine is not None:  # stuck in a step (a hung worker or GPU)
            log.warning("the engine thread did not stop in 10s: killing its tensor-parallel workers")
            self.engine.kill_workers()
            self._thread.join(timeout=20)

    # --- requests ----------------------------------------------------------------------
    async def score(self, req: ScoreRequest) -> ScoreResult:
        """Queue a request and wait for its result. Cancelling the awaiting task aborts it
        and frees its KV blocks."""
        loop = asyncio.get_running_loop()
        pending = _Pending(req, loop.create_future(), loop)
        with self._lock:  # checked and queued atomically with the engine thread's death
            if not self.alive:
                raise EngineUnavailable(self.fatal_error or "engine is not running")
            if not self.accepting:
                raise EngineUnavailable("server is shutting down")
            if (self._queued_requests + 1 > self.max_queue_requests
                    or self._queued_tokens + req.length > self.max_queue_tokens):
                raise EngineOverloaded(f"queue full ({self._queued_requests} requests, "
                                       f"{self._queued_tokens} tokens)")
            self._queued_requests += 1
            self._queued_tokens += req.length
            req.handed = time.monotonic()
            self._inbox.put(AddMsg(pending))
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._inbox.put(CancelMsg(pending))
            raise

    # --- engine thread -----------------------------------------------------------------
    def _release(self, req: ScoreRequest) -> None:
        with self._lock:
            self._queued_requests -= 1
            self._queued_tokens -= req.length

    def _deliver_all(self, results: list[ScoreResult]) -> None:
        for res in results:
            self._deliver(res)

    def _deliver(self, res: ScoreResult) -> None:
        p = self._pending.pop(res.uid, None)
        if p is not None:
            self._answer(p, res)

    def _answer(self, p: _Pending, res: ScoreResult) -> None:
        """Release ``p``'s place in the queue and set its caller's result."""
        self._release(p.req)

        def _set(f: asyncio.Future = p.future, r: ScoreResult = res) -> None:
            if not f.done():
                f.set_result(r)
        try:
            p.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _handle(self, msg: Msg) -> None:
        match msg:
            case AddMsg(pending=p):
                if p.req.uid in self._pending:  # the same ScoreRequest object again: refused, the first kept
                    self._answer(p, ScoreResult.failed(p.req, ErrorKind.INTERNAL, "this ScoreRequest object is "
                                                       "already queued (submit a new one for each call)"))
                    return
                self._pending[p.req.uid] = p
                try:
                    immediate = self.engine.add_request(p.req)
                except Exception as e:  # a request the engine refuses must not stop the thread
                    log.exception("request %s rejected by the engine", str(p.req.request_id)[:100])
                    immediate = ScoreResult.failed(p.req, ErrorKind.INTERNAL, str(e))
                if immediate is not None:
                    self._deliver(immediate)
            case CancelMsg(pending=p):
                if self._pending.get(p.req.uid) is not p:  # answered already (or a refused second submission)
                    return
                res = self.engine.abort_request(p.req.uid)
                if res is not None:
                    self._deliver(res)
            case ExitMsg():
                pass

    def _expire(self) -> None:
        now = time.monotonic()
        for uid, p in list(self._pending.items()):
            if p.req.deadline is not None and now > p.req.deadline:
                res = self.engine.abort_request(uid, ErrorKind.TIMEOUT, "request deadline exceeded")
                if res is not None:
                    self._deliver(res)

    def _run(self) -> None:
        if self.engine is None:
            try:
                self.engine = self._factory()
            except BaseException as e:
                self._build_error, self.alive = e, False
                self._built.set()
                return
        # Tensor parallel: a dead worker fails the engine at once, even mid-collective.
        self.engine.watch_workers(self._die)
        self._progress_at = time.monotonic()
        if self.stall_timeout_s is not None:
            threading.Thread(target=self._watch_progress, name="teacher-engine-stall", daemon=True).start()
        self._built.set()
        try:
            self._loop()
        except BaseException as e:  # fatal: the step failed its own requests (INTERNAL), answered first
            with self._lock:  # dead before they go out: a replica reads ``alive`` to hand them back
                self.alive = False
            try:
                self._deliver_all(self.engine.take_failed())
            except Exception:  # (answering them must not keep the rest from being answered)
                log.exception("answering a failed step's requests")
            self._die(e)
            return
        self.engine.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                block = not self.engine.has_unfinished()
                msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                if block:  # idle until now: the stall clock starts with this work
                    self._progress_at = time.monotonic()
                self._handle(msg)
                while True:  # take everything queued before the next step
                    self._handle(self._inbox.get_nowait())
            except queue.Empty:
                pass
            self._expire()
            if not self.engine.has_unfinished():
                self._progress_at = time.monotonic()
                continue
            results = self.engine.step(deliver=self._deliver_all)  # a step's results may come early
            if self.on_step is not None:
                self.on_step(self.engine, results)
            self._deliver_all(results)
            self._progress_at = time.monotonic()

    def _watch_progress(self) -> None:
        """Fail the engine when its thread has not come round for ``stall_timeout_s`` while
        requests wait on it. The turn of an idle engine ends every 0.5 s and a busy one's at
        each step, so only a step that does not end (a hung kernel, a collective waiting on a
        stopped rank) trips it; its requests are answered UNAVAILABLE at once (a replica's go
        to the others) and the hook runs (restart, or the process exits)."""
        bound = self.stall_timeout_s
        assert bound is not None
        while self.alive and not self._stop.is_set():
            time.sleep(min(1.0, bound / 4))
            idle_s = time.monotonic() - self._progress_at
            if idle_s > bound and self.in_flight > 0 and self.alive and not self._stop.is_set():
                self._die(EngineStalled(f"no step completed for {idle_s:.1f}s while holding {self.in_flight} "
                                        f"request(s) (stall_timeout_s={bound:g})"))
                return

    def _die(self, e: BaseException) -> None:
        """The engine cannot go on: answer every request it holds or that is still queued.
        Runs once (the engine thread and a tensor-parallel watchdog may both get here)."""
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = f"engine failed: {type(e).__name__}" + (f": {e}" if isinstance(e, EngineStalled) else "")
        log.critical("engine cannot recover: %s", e)
        with self._lock:  # after this no request can be queued any more
            self.alive = False
            while True:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, AddMsg):
                    self._pending[msg.pending.req.uid] = msg.pending
        # Not scored, and not for anything they did (a step's own requests were failed with it):
        # UNAVAILABLE, a 503 with Retry-After, so a client sends them to another server.
        for p in list(self._pending.values()):
            self._deliver(ScoreResult.failed(p.req, ErrorKind.UNAVAILABLE, self.fatal_error))
        if self.engine is not None:  # workers still running (a peer died, or this thread failed) go now
            self.engine.kill_workers()
        if self.on_fatal is not None:
            self.on_fatal(e)
