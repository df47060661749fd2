"""The engine's life in the app: built in the background at start-up, drained and cut off
at shutdown, and the signal handling of the command-line server around it.

Shutdown on SIGTERM/SIGINT (``DrainingServer``): new requests get 503 and ``/health`` turns
503 at once; in-flight requests finish for at most ``shutdown_timeout_s`` (T); those still
running then are dropped and answered 503 with Retry-After, and the process exits, about T
after the signal. A second signal exits at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from starlette.datastructures import State

from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreResult
from teacher_server.heap import freeze_start_up_heap, thaw_heap
from teacher_server.replicas.preload import end_stopped_fork_server
from teacher_server.server.metrics import Metrics
from teacher_server.validation import Limits

log = logging.getLogger("teacher_server.server")
GRACE_S = 2.0  # after the cut-off: time for the 503s to be written and the aborts to land


def start_engine(app: FastAPI, cfg: Config, factory: Callable[[Config], Engine],
                 on_step: Callable[[Engine, list[ScoreResult]], None], on_fatal: Callable[[BaseException], None],
                 on_start_failure: Callable[[], None] | None, st: State | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
    """Build the engine in the background (a daemon thread, so a shutdown during a long load
    does not wait for it); the app serves 503 until it is ready. ``st``: where the engine is
    kept (one teacher's state holder; default the app's), ``on_ready`` called once it is."""
    st = app.state if st is None else st
    log.info("loading model %s (device %s)", cfg.model or "demo", cfg.device)
    t0 = time.monotonic()

    def ready(ae: AsyncEngine) -> None:
        engine = ae.engine
        st.limits = Limits(engine.spec.vocab_size, engine.max_model_len, cfg.max_logprobs, cfg.max_rows_x_k,
                           cfg.max_prompt_logprobs_entries, priority_limit=cfg.priority_limit,
                           processed=cfg.logprobs_mode == "processed_logprobs", max_prompts=cfg.max_queue_requests)
        freeze_start_up_heap("server")  # (before the first request can come: the collection takes a while)
        st.queue_wait.step_budget(None, engine.tuning.token_budget)
        st.engine, st.aengine, st.status = engine, ae, "ready"
        st.metrics.set_healthy(True)
        log.info("engine ready in %.1fs: serving %s (max_model_len %d)", time.monotonic() - t0,
                 engine.served_model_name, engine.max_model_len)
        if on_ready is not None:
            on_ready()

    def failed(exc: BaseException) -> None:
        st.status, st.exit_code = "failed", 3
        log.critical("engine failed to start: %s: %s", type(exc).__name__, exc)
        (on_start_failure or terminate_self)()

    def build() -> None:
        # Built in the engine thread itself: per-thread GPU state made at start-up (cuDNN's
        # plan cache, filled by the attention warm-up) is then the one the steps use.
        try:
            ae = asyncio.run(AsyncEngine.build(
                lambda: factory(cfg), cfg.max_queue_requests, cfg.max_queue_tokens,
                on_step=on_step, on_fatal=on_fatal, stall_timeout_s=cfg.stall_timeout_s))
        except BaseException as e:
            _call_soon(st.loop, failed, e)
            return
        _call_soon(st.loop, ready, ae)

    threading.Thread(target=build, name="teacher-start", daemon=True).start()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed: the app is gone
        pass


def cut_off(app: FastAPI) -> None:
    """Stop waiting for in-flight requests: each is dropped and answered 503 with
    Retry-After. Safe to call from any thread (signal handlers, drain threads)."""
    st = app.state
    if getattr(st, "loop", None) is not None:
        _call_soon(st.loop, st.cutoff.set)


def in_flight(app: FastAPI, ae: AsyncEngine) -> int:
    """Requests a drain waits for: those the engine holds, and those scored whose answer is
    still being built (the engine counts them done)."""
    return max(ae.in_flight, getattr(app.state, "handling", 0))


async def stop_engine(app: FastAPI, cfg: Config) -> None:
    st = app.state
    thaw_heap()  # (this process may serve on: an app in a test, a restart in the same process)
    ae: AsyncEngine | None = st.aengine
    if ae is None:  # still loading (its thread is a daemon) or failed to start
        pool = getattr(st, "replica_pool", None)
        if pool is not None:  # replica processes are no daemons: stop them
            pool.shutdown()
        return
    ae.stop_accepting()
    if in_flight(app, ae) and not st.cutoff.is_set():
        log.info("draining %d in-flight request(s) (timeout %.0fs)", in_flight(app, ae), cfg.shutdown_timeout_s)
        deadline = time.monotonic() + cfg.shutdown_timeout_s
        while in_flight(app, ae) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if in_flight(app, ae):
            log.warning("shutdown timeout: %d request(s) still in flight", in_flight(app, ae))
    st.cutoff.set()
    await ae.drain(GRACE_S)  # the cut-off requests' aborts reach the engine thread
    ae.shutdown()


def on_engine_fatal(app: FastAPI, exc: BaseException, hook: Callable[[], None] | None,
                    metrics: Metrics | None = None) -> None:
    """The engine cannot recover: report unhealthy (in ``metrics``, the failed teacher's; by
    default the service's) and ask the process to exit (``hook``, by default
    ``terminate_self``) so the orchestrator restarts it."""
    m: Metrics = metrics if metrics is not None else app.state.metrics
    if m.replicas == 1:  # a replica that went down has already marked its own series
        m.set_healthy(False)
    app.state.exit_code = 3
    log.critical("engine failed (%s); exiting", exc)
    (hook or terminate_self)()


FATAL_EXIT_S = 30.0  # after a fatal engine error the process is gone by then at the latest (or after its drain)
_SERVER: DrainingServer | None = None  # this process's command-line server, once made


def terminate_self() -> None:
    """Stop this process through the usual shutdown: ``DrainingServer.fatal_shutdown`` when
    the command-line server runs (no signal: the operator's signals keep their meaning), else
    SIGTERM. Should that not finish (an engine thread stuck in a collective of a dead
    tensor-parallel rank keeps the interpreter from exiting), end it with code 3 after
    ``FATAL_EXIT_S`` (or the server's drain and its grace, when longer)."""
    server = _SERVER
    limit = FATAL_EXIT_S if server is None else max(FATAL_EXIT_S, server.drain_timeout + GRACE_S + 10.0)

    def hard_exit() -> None:
        time.sleep(limit)
        log.critical("still running %.0fs after a fatal engine error: exiting", limit)
        end_stopped_fork_server()  # (os._exit runs no exit hooks)
        logging.shutdown()
        os._exit(3)

    threading.Thread(target=hard_exit, name="teacher-fatal-exit", daemon=True).start()
    if server is not None:
        server.fatal_shutdown()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the shutdown above (uvicorn alone would wait for connections
    and then for the lifespan, each with its own timeout)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        global _SERVER
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self._draining = False
        _SERVER = self  # terminate_self reaches it without a signal

    def handle_exit(self, sig: int, frame: object) -> None:
        ae: AsyncEngine | None = getattr(self.app.state, "aengine", None)
        if self._draining:  # a second signal: answer what is in flight with 503 and go
            log.warning("signal %s again: exiting now", sig)
            cut_off(self.app)
            self.force_exit = True
            return super().handle_exit(sig, frame)
        if ae is None:  # still loading (or failed): nothing to drain
            return super().handle_exit(sig, frame)
        self._drain(ae, f"signal {sig}")

    def fatal_shutdown(self) -> None:
        """The engine cannot go on (``terminate_self``): drain like a first signal, on the
        event loop's thread (where signal handlers run too), without a signal to record, so
        uvicorn does not re-raise one at exit and the exit code stays the app's (3). During a
        drain already under way nothing changes: a replica or worker that died mid-drain does
        not cut the others' requests off as an operator's second signal would."""
        loop = getattr(self.app.state, "loop", None)
        if loop is not None and threading.current_thread() is not threading.main_thread():
            _call_soon(loop, self.fatal_shutdown)
            return
        if self._draining:
            log.warning("fatal engine error during the drain: the drain goes on")
            return
        ae: AsyncEngine | None = getattr(self.app.state, "aengine", None)
        if ae is None:
            self.should_exit = True
            return
        self._drain(ae, "fatal engine error")

    def _drain(self, ae: AsyncEngine, why: str) -> None:
        self._draining = True
        ae.stop_accepting()
        log.info("%s: draining %d in-flight request(s), at most %.0fs", why, in_flight(self.app, ae),
                 self.drain_timeout)

        def drain_then_exit() -> None:
            deadline = time.monotonic() + self.drain_timeout
            while in_flight(self.app, ae) and time.monotonic() < deadline:
                time.sleep(0.05)
            if in_flight(self.app, ae):
                log.warning("drain timeout: answering %d in-flight request(s) with 503", in_flight(self.app, ae))
            # What is still in flight, and requests still sending their bodies (not in flight yet:
            # uvicorn's own shutdown would cancel them, a plain-text 500), get their JSON 503 now.
            cut_off(self.app)
            grace = time.monotonic() + GRACE_S
            while in_flight(self.app, ae) and time.monotonic() < grace:
                time.sleep(0.05)
            time.sleep(0.2)  # (the answers to bodies still arriving are written)
            self.should_exit = True

        threading.Thread(target=drain_then_exit, name="teacher-drain", daemon=True).start()
