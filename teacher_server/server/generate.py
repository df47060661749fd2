"""``POST /inference/v1/generate`` from the request to its answer: read and parse the body off
the event loop when it is large, hand the request to the engine, wait for it (or for the
client to leave, the deadline, or the shutdown's cut-off), and build the response."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import State

from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult
from teacher_server.server import parsing
from teacher_server.server.admission import QueueTooLong, QueueWait
from teacher_server.server.byte_budget import Hold, OverBudget, native_held_bytes, over_budget
from teacher_server.server.errors import HTTP_STATUS, http_status, retry_after
from teacher_server.server.http import ClientGone, read_body
from teacher_server.server.metrics import Metrics
from teacher_server.server.responses import HeldResponse, error_response, generate_body, request_id_header
from teacher_server.server.teacher_set import Teachers
from teacher_server.validation import BadRequest

access_log = logging.getLogger("teacher_server.access")
TIMEOUT_HEADER = "x-request-timeout"  # a request's own time limit, in seconds

_DEADLINE_GRACE_S = 1.0  # past a request's deadline, before the front answers for an engine that has not
INLINE_BYTES = 256 * 1024  # bodies and results above this are (de)serialised in a worker thread
# Threads for that work. It holds the GIL (orjson, base64, numpy on small arrays), so more
# threads parse no faster, and each runnable one takes a share of the GIL from the engine
# thread, whose kernel launches must keep the GPU fed: with asyncio's default pool (up to 32
# threads) a burst of large requests starved the GPU for seconds.
IO_THREADS = 1


class RequestInfo:
    """What the access line reports about a request, filled in as it is learnt."""

    def __init__(self, header_request_id: str | None) -> None:
        self.header_request_id = header_request_id
        self.request_id = header_request_id
        self.call_id: str | None = None  # a trainers' endpoint's call as its answer names it (ours where unnamed)
        self.tokens = 0
        self.rows = 0
        self.admitted = False  # handed to the engine (counted in ``app.state.handling``)
        self.scored = False  # the engine's result is in
        self.teacher: State | None = None  # the teacher the request named, once known


async def handle_generate(request: Request, cfg: Config) -> Response:
    """The endpoint: the request's work, cut off by the shutdown (then 503 with Retry-After)
    unless its result is in; counted, timed and logged on the access line."""
    t0 = time.monotonic()
    st = request.app.state
    m: Metrics = st.metrics
    info = RequestInfo(request.headers.get("x-request-id"))
    work = asyncio.ensure_future(_generate(request, cfg, t0, info))
    cut = not await finished_unless_cut_off(st, work, info)
    resp = shut_down_response() if cut else work.result()
    dt = time.monotonic() - t0
    m = m if info.teacher is None else info.teacher.metrics  # (counted under the teacher it named)
    if cut:
        m.labels(m.failures, reason="shutdown").inc()
    m.labels(m.requests, status=str(resp.status_code)).inc()
    m.labels(m.e2e).observe(dt)
    if info.request_id is None:  # refused before an id was read: one of ours, so the caller can quote it
        info.request_id = f"score-{uuid.uuid4().hex}"
    resp.headers.update(request_id_header(info.request_id))
    rid = info.request_id[:128]
    reason = error_reason(resp)
    access_log.info("generate %s -> %d tokens=%d rows=%d %.3fs%s", rid, resp.status_code, info.tokens, info.rows,
                    dt, f" reason={reason}" if reason else "",
                    extra={"request_id": rid, "status": resp.status_code, "latency_s": round(dt, 4),
                           "tokens": info.tokens, "rows": info.rows, **({"reason": reason} if reason else {})})
    return resp


async def finished_unless_cut_off(st: State, work: asyncio.Future, info: RequestInfo) -> bool:
    """Whether a request's ``work`` (body, admission, scoring, answer) finished before the
    shutdown's cut-off (``lifecycle.cut_off``); one whose result is in is waited for (its answer
    is being built, not dropped). Work cut off is cancelled: its engine work dropped, KV freed."""
    cutoff = asyncio.ensure_future(st.cutoff.wait())
    try:
        await asyncio.wait({work, cutoff}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and info.scored:
            await asyncio.wait({work})
    except BaseException:  # this handler was cancelled (the server's own shutdown): so is its work
        work.cancel()
        raise
    finally:
        cutoff.cancel()
    if not work.done():
        work.cancel()
    return work.done() and not work.cancelled()


def observe_scored(m: Metrics, req: ScoreRequest, res: ScoreResult) -> None:
    """A scored request's series (every endpoint's): its tokens, its result rows, its time
    queued and its time in the engine."""
    m.labels(m.queue_time).observe(max(res.scheduled_at - req.arrival, 0.0) if res.scheduled_at else 0.0)
    if res.scheduled_at:
        m.labels(m.inference_time).observe(max(res.finished_at - res.scheduled_at, 0.0))
    m.labels(m.prompt_tokens).inc(req.length)
    m.labels(m.scored_rows).inc(req.rows if req.candidates is not None or req.row_targets else 0)


def shut_down_response() -> Response:
    """503 with Retry-After: the drain's time ran out before the request's answer was ready."""
    return error_response(503, "server shut down before the request finished; retry on another replica",
                          headers=retry_after(ErrorKind.UNAVAILABLE))


def error_reason(resp: Response, limit: int = 200) -> str | None:
    """An error response's message (its first ``limit`` characters) for the access line, so a
    refused request's line says why without the client's copy of the answer."""
    if resp.status_code < 400:
        return None
    try:
        return str(orjson.loads(resp.body)["error"]["message"])[:limit]
    except (ValueError, KeyError, TypeError):
        return None


async def _generate(request: Request, cfg: Config, t0: float, info: RequestInfo) -> Response:
    hold = Hold(request.app.state.byte_budget)  # this request's bytes in flight, until its answer is sent
    resp: Response | None = None
    try:
        resp = await _generate_counted(request, cfg, t0, info, hold)
        return resp
    finally:
        if info.admitted:  # counted at admission (``app.state.handling``), uncounted on every way out
            request.app.state.handling -= 1
        if not isinstance(resp, HeldResponse):  # (a held answer gives its bytes back once it is sent)
            hold.release()


def request_timeout(request: Request, cfg: Config) -> float | None:
    """The request's time limit in seconds: the ``X-Request-Timeout`` header (a positive number
    of seconds), within ``request_timeout_s`` when that is set; None: no deadline."""
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return cfg.request_timeout_s
    try:
        own = float(text)
    except ValueError:
        own = float("nan")
    if not (0 < own < 1e9):  # (also NaN and infinity)
        raise BadRequest(f"{TIMEOUT_HEADER} must be a positive number of seconds below 1e9, got {text[:40]!r}",
                         TIMEOUT_HEADER)
    return own if cfg.request_timeout_s is None else min(own, cfg.request_timeout_s)


def ready_engine(request: Request, teacher: State | None = None) -> AsyncEngine:
    """The engine (of ``teacher``; default the service's, all teachers'), when it takes
    requests and the body's encoding is one it reads; EngineUnavailable (503) or BadRequest
    otherwise."""
    st = request.app.state
    ae: AsyncEngine | None = (st if teacher is None else teacher).aengine
    if ae is None and teacher is None and st.teachers.single is None:
        # several teachers, some still loading: those ready take their requests (the body says which)
        ae = next((t.aengine for t in st.teachers.all if t.aengine is not None), None)
    if ae is None:
        raise EngineUnavailable("engine is loading")
    if not ae.accepting or not ae.alive:
        raise EngineUnavailable("server is shutting down" if ae.alive else ae.fatal_error)
    # the codings of every Content-Encoding line (a list split over two lines is one list)
    codings = [c.strip() for v in request.headers.getlist("content-encoding") for c in v.lower().split(",")]
    coding = ", ".join(c for c in codings if c not in ("", "identity"))
    if coding:
        raise BadRequest(f"Content-Encoding {coding[:40]!r} is not supported: send the JSON body uncompressed")
    return ae


def refuse_long_wait(queue: QueueWait, cfg: Config, priority: int) -> None:
    """QueueTooLong when the work ahead of a request of ``priority`` would take longer than
    ``max_queue_wait_s`` at the measured throughput."""
    late = queue.refuse(priority)
    if late is not None:
        raise QueueTooLong(f"queue too long: the work ahead of this request would take "
                           f"{late + cfg.max_queue_wait_s:.0f}s at the measured throughput, more than "
                           f"max_queue_wait_s={cfg.max_queue_wait_s:g}", math.ceil(late))


def refusal_reason(e: BadRequest) -> str:
    """The failure metric's reason for a request refused with ``e``."""
    return {400: "validation", 404: "unknown_model", 408: "body_timeout", 413: "too_large",
            415: "unsupported_media_type"}.get(e.status, "validation")


def busy_response(e: OverBudget | QueueTooLong, m: Metrics) -> Response:
    """429 with Retry-After for a request refused by the byte budget or the queue's wait."""
    m.labels(m.failures, reason="over_budget" if isinstance(e, OverBudget) else "queue_wait").inc()
    return error_response(429, str(e), headers={"Retry-After": str(e.retry_after_s)})


async def _generate_counted(request: Request, cfg: Config, t0: float, info: RequestInfo, hold: Hold) -> Response:
    app = request.app
    m: Metrics = app.state.metrics
    teachers: Teachers = app.state.teachers
    try:
        ae = ready_engine(request, teachers.single)
        timeout_s = request_timeout(request, cfg)
        raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s, app.state.body_gate, hold)
        body_read = time.monotonic()
        # several teachers: the body's `model` says which (its JSON object, parsed there, handed on)
        t, obj = (teachers.single, None) if teachers.single else await teachers.pick(raw, app.state.io_pool)
        info.teacher, m = t, t.metrics  # (a refusal below is counted under the teacher named)
        ae = ready_engine(request, t)
        queue: QueueWait = t.queue_wait  # (each teacher's wait is its own queue over its own throughput)
        engine: Engine = t.engine
        # Parsing and validating a large body takes a while: keep it off the event loop.
        args = (raw, t.limits, engine.served_model_name, info.header_request_id, t.cfg.served_names, obj)
        body, req = await asyncio.get_running_loop().run_in_executor(app.state.io_pool, parsing.parse_request, *args) \
            if len(raw) > INLINE_BYTES else parsing.parse_request(*args)
        echo_ids = bool(body.return_token_ids)
        del raw, args, body, obj  # the bytes and their parsed copy (a large ignored field too) are let go here
        info.request_id, info.tokens, info.rows = req.request_id, req.length, req.rows
        req.received, req.body_read = t0, body_read  # (the step trace's clocks of its way in)
        if req.length > t.cfg.max_queue_tokens:  # could never be admitted: retrying cannot help
            raise BadRequest(f"token_ids has {req.length} tokens, more than the queue holds "
                             f"(max_queue_tokens={t.cfg.max_queue_tokens})", "token_ids")
        # From here the request holds its arrays and, until it is sent, its result.
        if not hold.resize(need := native_held_bytes(req)):
            raise over_budget(hold, need)
        refuse_long_wait(queue, cfg, req.priority)
        if timeout_s is not None:
            req.deadline = t0 + timeout_s
        info.admitted = True
        app.state.handling += 1
        queue.admit(req.priority, req.length)
        task = asyncio.ensure_future(ae.score(req))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        # The engine answers a request past its deadline itself (504) between steps and drops its
        # work; this bound holds when it cannot (a step that does not end: a hung GPU or worker).
        limit = None if req.deadline is None else max(req.deadline - time.monotonic(), 0.0) + _DEADLINE_GRACE_S
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED, timeout=limit)
        finally:
            watcher.cancel()
            if not task.done():  # cancelled from outside (shutdown), the client went away, or the deadline
                task.cancel()
            answered = task.done() and not task.cancelled() and task.exception() is None
            queue.finish(req.priority, req.length, answered and task.result().error is None,
                         step_end=task.result().finished_at if answered else None)
        if not done:
            m.labels(m.failures, reason="timeout").inc()
            return error_response(504, "request deadline exceeded: the engine did not answer in time")
        if task not in done:  # the client went away: drop its work and free its KV
            raise ClientGone("client disconnected")
        res = task.result()
        info.scored = True
    except BadRequest as e:
        info.request_id = e.request_id or info.request_id
        m.labels(m.failures, reason=refusal_reason(e)).inc()
        return error_response(e.status, e.message, e.param)
    except ClientGone as e:
        m.labels(m.failures, reason="disconnected").inc()
        return error_response(499, str(e))  # nobody reads it; the access line records it
    except (EngineOverloaded, EngineUnavailable) as e:
        m.labels(m.failures, reason=e.kind.value).inc()
        return error_response(HTTP_STATUS[e.kind], str(e), headers=retry_after(e.kind))
    except (OverBudget, QueueTooLong) as e:
        return busy_response(e, m)
    if res.error is not None:  # (a replica's full queue or drain comes back as a result: Retry-After too)
        m.labels(m.failures, reason=res.error_kind or "internal").inc()
        return error_response(http_status(res.error_kind), res.error, headers=retry_after(res.error_kind))
    observe_scored(m, req, res)
    build = lambda: generate_body(req, res, engine.served_model_name, echo_ids)  # noqa: E731
    pool = app.state.plp_pool if req.prompt_logprobs is not None else \
        app.state.io_pool if req.rows * max(req.k + 2 * req.top_k, 1) > INLINE_BYTES // 4 else None
    content = await asyncio.get_running_loop().run_in_executor(pool, build) if pool is not None else build()
    return HeldResponse(content, hold)


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has gone. The body has been read, so the server's next ASGI
    message for this request is ``http.disconnect``, sent when the connection closes: waiting
    for it costs nothing while the request waits, where polling ``is_disconnected`` ran a
    cancelled receive four times a second per waiting request on the event loop (small each
    time, ~10 us measured, but work that shares the GIL with the engine thread)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.25)  # (no server sends more of a body it has finished; never busy-wait)
