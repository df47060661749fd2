"""Several teachers' life in the app: each started as one teacher is (its replicas or its
engine in processes of its own, on its GPUs), the service ready once all are, and
``/health`` over all of them.

Health with several teachers: 200 ``ready`` when every teacher's replicas all serve; 200
``degraded`` when every teacher has at least one replica serving and some replica is down or
restarting; 503 when a teacher cannot serve at all (loading, failed, no replica up) or the
service drains. A trainer that picks teachers per sample cannot go on without one of them, so a
load balancer should send its traffic to a pod where all serve; requests to the teachers that do
serve are still answered meanwhile. The body names each teacher's state under ``teachers``."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.datastructures import State

from teacher_server.replicas.pool import engine_elsewhere
from teacher_server.server.lifecycle import on_engine_fatal, start_engine, terminate_self
from teacher_server.server.replica_lifecycle import start_replicas
from teacher_server.server.responses import error_body, json_response
from teacher_server.server.teacher_set import TeacherPools, TeacherSetEngine, teacher_health

log = logging.getLogger("teacher_server.server")


def start_teachers(app: FastAPI, teachers: list[State], factory: Callable, on_fatal: Callable[[], None] | None) -> None:
    """Start every teacher; each takes its requests once it is ready (``ready_engine``), the
    service's ``app.state.aengine`` is the set of them once all are. A teacher that cannot
    start, or whose replicas keep failing, ends the service with exit 3 as one teacher's engine
    does (its orchestrator restarts it)."""
    st = app.state
    st.replica_pool = TeacherPools(teachers)  # stopped by stop_engine should the service end while they start

    def failed_to_start() -> None:
        st.exit_code = 3  # (the process's: a teacher's own state had it, and the service exited 0)
        (on_fatal or terminate_self)()

    def ready() -> None:
        if all(t.aengine is not None for t in teachers):
            st.engine, st.aengine, st.status = teachers[0].engine, TeacherSetEngine(teachers), "ready"
            log.info("all %d teachers ready: %s", len(teachers), ", ".join(t.cfg.served_name for t in teachers))

    for t in teachers:
        start = start_replicas if engine_elsewhere(t.cfg) else start_engine
        start(app, t.cfg, factory, on_step=lambda e, results, t=t: t.metrics.observe_engine(e.stats()),
              on_fatal=lambda exc, t=t: on_engine_fatal(app, RuntimeError(f"teacher {t.cfg.served_name}: {exc}"),
                                                         on_fatal, t.metrics),
              on_start_failure=failed_to_start, st=t, on_ready=ready)


def teachers_health(st: State) -> Response:
    """``/health`` with several teachers (the module's docstring says what each answer means)."""
    each = {t.cfg.served_name: teacher_health(t) for t in st.teachers.all}
    states = [h["status"] for h in each.values()]
    ae = st.aengine
    if ae is not None and not ae.accepting:
        status = "draining"
    elif any(s in ("failed", "draining") for s in states):
        status = "failed" if "failed" in states else "draining"
    elif any(s == "loading" for s in states):
        status = "loading"
    else:
        status = "ready" if all(s == "ready" for s in states) else "degraded"
    if status in ("ready", "degraded"):
        body = {"status": status, "teachers": each}
        if status == "degraded":
            serving, total = ae.capacity
            body |= {"replicas_serving": serving, "replicas": total,
                     "message": "; ".join(f"{n}: {h['replicas'] - h['replicas_serving']} replica(s) not serving"
                                          for n, h in each.items() if h["status"] == "degraded")}
        return json_response(200, body)
    down = [f"{n} ({h.get('message', h['status'])})" for n, h in each.items()
            if h["status"] not in ("ready", "degraded")]
    message = "server is shutting down" if status == "draining" else f"teacher(s) not serving: {', '.join(down)}"
    return json_response(503, {"status": status, "teachers": each, **error_body(503, message)})
