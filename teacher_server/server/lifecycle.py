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

from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreResult
from teacher_server.validation import Limits

log = logging.getLogger("teacher_server.server")
GRACE_S = 2.0  # after the cut-off: time for the 503s to be written and the aborts to land


def start_engine(app: FastAPI, cfg: Config, factory: Callable[[Config], Engine],
                 on_step: Callable[[Engine, list[ScoreResult]], None], on_fatal: Callable[[BaseException], None],
                 on_start_failure: Callable[[], None] | None) -> None:
    """Build the engine in the background (a daemon thread, so a shutdown during a long load
    does not wait for it); the app serves 503 until it is ready."""
    st = app.state
    log.info("loading model %s (device %s)", cfg.model or "demo", cfg.device)
    t0 = time.monotonic()

    def ready(ae: AsyncEngine) -> None:
        engine = ae.engine
        st.limits = Limits(engine.spec.vocab_size, engine.max_model_len, cfg.max_logprobs, cfg.max_rows_x_k,
                           cfg.max_prompt_logprobs_entries)
        st.engine, st.aengine, st.status = engine, ae, "ready"
        st.metrics.set_healthy(True)
        log.info("engine ready in %.1fs: serving %s (max_model_len %d)", time.monotonic() - t0,
                 engine.served_model_name, engine.max_model_len)

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
                on_step=on_step, on_fatal=on_fatal))
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


async def stop_engine(app: FastAPI, cfg: Config) -> None:
    st = app.state
    ae: AsyncEngine | None = st.aengine
    if ae is None:  # still loading (its thread is a daemon) or failed to start
        pool = getattr(st, "replica_pool", None)
        if pool is not None:  # replica processes are no daemons: stop them
            pool.shutdown()
        return
    ae.stop_accepting()
    if ae.in_flight and not st.cutoff.is_set():
        log.info("draining %d in-flight request(s) (timeout %.0fs)", ae.in_flight, cfg.shutdown_timeout_s)
        if not await ae.drain(cfg.shutdown_timeout_s):
            log.warning("shutdown timeout: %d request(s) still in flight", ae.in_flight)
    st.cutoff.set()
    await ae.drain(GRACE_S)  # the cut-off requests' aborts reach the engine thread
    ae.shutdown()


FATAL_EXIT_S = 30.0  # after a fatal engine error the process is gone by then at the latest
# Set just before ``terminate_self`` signals this process: that SIGTERM is the fatal path's own,
# not an operator's (``DrainingServer`` neither re-raises it at exit nor takes it for a second one).
_FATAL_SIGNAL = threading.Event()


def terminate_self() -> None:
    """Stop this process through the usual shutdown (SIGTERM); should that not finish (an
    engine thread stuck in a collective of a dead tensor-parallel rank keeps the interpreter
    from exiting), end it with code 3 after ``FATAL_EXIT_S``."""
    def hard_exit() -> None:
        time.sleep(FATAL_EXIT_S)
        log.critical("still running %.0fs after a fatal engine error: exiting", FATAL_EXIT_S)
        logging.shutdown()
        os._exit(3)

    threading.Thread(target=hard_exit, name="teacher-fatal-exit", daemon=True).start()
    _FATAL_SIGNAL.set()
    os.kill(os.getpid(), signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the shutdown above (uvicorn alone would wait for connections
    and then for the lifespan, each with its own timeout)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: object) -> None:
        ae: AsyncEngine | None = getattr(self.app.state, "aengine", None)
        fatal = sig == signal.SIGTERM and _FATAL_SIGNAL.is_set()  # sent by terminate_self
        _FATAL_SIGNAL.clear()
        if self._draining:
            if fatal:  # a replica or worker died mid-drain: the others' requests still finish
                log.warning("fatal engine error during the drain: the drain goes on")
                return None
            # a second signal: answer what is in flight with 503 and go
            log.warning("signal %s again: exiting now", sig)
            cut_off(self.app)
            self.force_exit = True
            return super().handle_exit(sig, frame)
        if ae is None:  # still loading (or failed): nothing to drain
            if fatal:  # not recorded: uvicorn would re-raise it at exit, ending with 143, not the exit code 3
                self.should_exit = True
                return None
            return super().handle_exit(sig, frame)
        self._draining = True
        ae.stop_accepting()
        log.info("signal %s: draining %d in-flight request(s), at most %.0fs", sig, ae.in_flight, self.drain_timeout)

        def drain_then_exit() -> None:
            deadline = time.monotonic() + self.drain_timeout
            while ae.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            if ae.in_flight:
                log.warning("drain timeout: answering %d in-flight request(s) with 503", ae.in_flight)
                cut_off(self.app)
                grace = time.monotonic() + GRACE_S
                while ae.in_flight and time.monotonic() < grace:
                    time.sleep(0.05)
            self.should_exit = True

        threading.Thread(target=drain_then_exit, name="teacher-drain", daemon=True).start()
