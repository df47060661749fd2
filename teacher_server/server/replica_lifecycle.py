"""The replica pool's life in the app: what ``server.lifecycle.start_engine`` does for one
engine, for ``data_parallel_size`` > 1, or for one engine in a process of its own
(``engine_process``). Shutdown is the same code (``stop_engine`` and the draining server
drive the pool through the AsyncEngine surface)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI
from starlette.datastructures import State

from teacher_server.config import Config
from teacher_server.engine.stats import EngineStats
from teacher_server.heap import freeze_start_up_heap
from teacher_server.replicas.messages import ReplicaInfo
from teacher_server.replicas.pool import ReplicaPool
from teacher_server.server.lifecycle import terminate_self
from teacher_server.validation import Limits

log = logging.getLogger("teacher_server.server")


class PoolEngineInfo:
    """Stands for the engine in ``app.state.engine``: what the routes read of it."""

    def __init__(self, info: ReplicaInfo) -> None:
        self.served_model_name = info.served_model_name
        self.model_dir = info.model_dir
        self.max_model_len = info.max_model_len


def start_replicas(app: FastAPI, cfg: Config, factory: Callable[[Config], object],
                   on_step: Callable | None, on_fatal: Callable[[BaseException], None],
                   on_start_failure: Callable[[], None] | None, st: State | None = None,
                   on_ready: Callable[[], None] | None = None) -> None:
    """Start the replica processes (each builds its engine) and serve once all are ready;
    ``on_start_failure`` when one cannot start. A replica that goes down later is restarted by
    the pool while the others serve (its ``_healthy`` series reads 0 meanwhile, and
    ``_engine_restarts_total`` counts it); ``on_fatal`` when the pool gives up (a replica failing
    again and again soon after each start while none serves). ``on_step`` is unused: replicas
    report their engines' snapshots themselves. ``st`` and ``on_ready`` as for
    ``start_engine``."""
    st = app.state if st is None else st
    m = st.metrics
    if cfg.data_parallel_size == 1:
        log.info("starting the engine of %s in a process of its own (device %s)", cfg.model or "demo", cfg.device)
    else:
        log.info("starting %d replicas of %s (device %s, routing %s)", cfg.data_parallel_size, cfg.model or "demo",
                 cfg.device, cfg.routing)
    t0 = time.monotonic()

    def up(index: int, restarted: bool) -> None:
        m.set_healthy(True, index)
        if restarted:
            m.engine_labels(m.restarts, index if m.replicas > 1 else None).inc()

    def stats(index: int, s: EngineStats) -> None:
        m.observe_engine(s, index)
        st.queue_wait.step_budget(index, s.token_budget)

    pool = ReplicaPool(cfg, factory, on_stats=stats,
                       on_down=lambda index, why: m.set_healthy(False, index), on_up=up,
                       on_give_up=lambda why: on_fatal(RuntimeError(why)))
    pool.start()

    async def wait() -> None:
        try:
            info = await pool.ready()
        except Exception as e:
            st.status, st.exit_code = "failed", 3
            log.critical("replicas failed to start: %s", e)
            (on_start_failure or terminate_self)()
            return
        st.limits = Limits(info.vocab_size, info.max_model_len, cfg.max_logprobs, cfg.max_rows_x_k,
                           cfg.max_prompt_logprobs_entries, priority_limit=cfg.priority_limit,
                           processed=cfg.logprobs_mode == "processed_logprobs",
                           max_prompts=cfg.max_queue_requests * cfg.data_parallel_size)  # (every replica's queue)
        freeze_start_up_heap("server")  # (before the first request can come: the collection takes a while)
        st.engine, st.aengine, st.status = PoolEngineInfo(info), pool, "ready"
        m.set_healthy(True)
        what = "engine (its own process)" if cfg.data_parallel_size == 1 else f"{cfg.data_parallel_size} replicas"
        log.info("%s ready in %.1fs: serving %s (max_model_len %d)", what, time.monotonic() - t0,
                 info.served_model_name, info.max_model_len)
        if on_ready is not None:
            on_ready()

    st.replica_start = asyncio.ensure_future(wait())
    st.replica_pool = pool  # shut down by stop_engine once ready; before that, by the lifespan's end
