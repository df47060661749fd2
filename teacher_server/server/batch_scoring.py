"""The request flow of the trainers' endpoints (``/v1/completions``, SGLang's ``/generate``):
read the body, parse it into engine requests (one per prompt of a batch), score them all
concurrently, and build the endpoint's JSON off the event loop. The endpoint modules give the
parsing and the building; this holds what they share with the native endpoint's flow: the
engine's availability, the deadline, a client that leaves (its requests are dropped), the
status and access line, and the admission (byte budget, estimated wait, deadline)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import State

from teacher_server.config import Config
from teacher_server.engine.async_engine import EngineOverloaded, EngineUnavailable
from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.server.admission import QueueTooLong, QueueWait
from teacher_server.server.byte_budget import Hold, OverBudget, json_held_bytes, over_budget
from teacher_server.server.errors import HTTP_STATUS, http_status, retry_after
from teacher_server.server.generate import (
    INLINE_BYTES,
    RequestInfo,
    _wait_disconnect,
    busy_response,
    error_reason,
    finished_unless_cut_off,
    observe_scored,
    ready_engine,
    refusal_reason,
    refuse_long_wait,
    request_timeout,
    shut_down_response,
)
from teacher_server.server.http import ClientGone, read_body
from teacher_server.server.metrics import Metrics
from teacher_server.server.responses import HeldResponse, error_response, request_id_header
from teacher_server.server.teacher_set import Teachers
from teacher_server.server.tokenizer import Tokenizer
from teacher_server.validation import BadRequest, Limits

access_log = logging.getLogger("teacher_server.access")
_DEADLINE_GRACE_S = 1.0


class Parsed(Protocol):
    """What an endpoint's parser gives: the engine requests, in the response's order, and the
    id the access line names the call by."""

    reqs: list[ScoreRequest]
    request_id: str


# (body, limits, served name, tokenizer, the other served names, the X-Request-Id header, the body's JSON object
# where parsed already)
Parse = Callable[[bytes, Limits, str, "Tokenizer | None", tuple[str, ...], "str | None", "dict | None"], Any]
Build = Callable[[Any, list[ScoreResult], str, "Tokenizer | None"], bytes]


def tokenizer_of(st: State) -> Tokenizer | None:
    """The checkpoint's tokenizer of a teacher (``st``: its state holder), loaded on first use
    (None: the model has none)."""
    if not hasattr(st, "tokenizer"):
        st.tokenizer = Tokenizer.load(getattr(st.engine, "model_dir", None))
    return st.tokenizer


async def _all_scored(tasks: list[asyncio.Future]) -> list[ScoreResult]:
    """Every prompt's result; as soon as one prompt is refused (a full queue, a drain: it
    raises), the others are cancelled and the refusal raised: a batch is admitted or refused as
    one call, and a refused one spends nothing on its other prompts."""
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    refused = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
    if refused is not None:
        for t in pending:
            t.cancel()  # drops their work and frees their KV
        raise refused
    return [t.result() for t in tasks]


async def handle_scoring(request: Request, cfg: Config, name: str, parse: Parse, build: Build) -> Response:
    """One call of a trainers' endpoint ``name``: parse -> score every prompt -> build."""
    t0 = time.monotonic()
    m: Metrics = request.app.state.metrics
    rid = request.headers.get("x-request-id")
    hold = Hold(request.app.state.byte_budget)  # the call's bytes in flight, until its answer is sent
    resp: Response | None = None
    info = RequestInfo(rid)  # (its teacher, once the body names it)
    try:
        try:
            # the drain's cut-off answers it 503 as the native endpoint's (not uvicorn's plain 500 at exit)
            work = asyncio.ensure_future(_score(request, cfg, t0, parse, build, hold, info, name))
            cut = not await finished_unless_cut_off(request.app.state, work, info)
            resp = shut_down_response() if cut else work.result()
        finally:
            m = m if info.teacher is None else info.teacher.metrics  # counted under the teacher named
        if cut:
            m.labels(m.failures, reason="shutdown").inc()
    except BadRequest as e:
        info.request_id = e.request_id or info.request_id
        m.labels(m.failures, reason=refusal_reason(e)).inc()
        resp = error_response(e.status, e.message, e.param)
    except ClientGone as e:
        m.labels(m.failures, reason="disconnected").inc()
        resp = error_response(499, str(e))
    except (EngineOverloaded, EngineUnavailable) as e:
        m.labels(m.failures, reason=e.kind.value).inc()
        resp = error_response(HTTP_STATUS[e.kind], str(e), headers=retry_after(e.kind))
    except (OverBudget, QueueTooLong) as e:
        resp = busy_response(e, m)
    finally:
        if not isinstance(resp, HeldResponse):  # (a held answer gives its bytes back once it is sent)
            hold.release()
    dt = time.monotonic() - t0
    m.labels(m.requests, status=str(resp.status_code)).inc()
    m.labels(m.e2e).observe(dt)
    # the header the client sent comes back as it was; else the call's own id (a refusal before one was
    # read: one of ours, so the caller can quote it)
    logged = (info.call_id if resp.status_code < 400 else None) or info.request_id or rid or f"score-{uuid.uuid4().hex}"
    resp.headers.update(request_id_header(rid if rid is not None else logged))
    logged = logged[:128]
    reason = error_reason(resp)
    access_log.info("%s %s -> %d tokens=%d rows=%d %.3fs%s", name, logged, resp.status_code, info.tokens, info.rows,
                    dt, f" reason={reason}" if reason else "",
                    extra={"request_id": logged, "status": resp.status_code, "latency_s": round(dt, 4),
                           "tokens": info.tokens, "rows": info.rows, **({"reason": reason} if reason else {})})
    return resp


async def _score(request: Request, cfg: Config, t0: float, parse: Parse, build: Build,
                 hold: Hold, info: RequestInfo, name: str) -> Response:
    """The call's work, admitted as the native endpoint's is: the byte budget (the body while
    it is read, then the requests' arrays and answer until it is sent), the queue's estimated
    wait, and the deadline (``X-Request-Timeout`` within ``request_timeout_s``: 504, and the
    prompts' work dropped)."""
    app = request.app
    teachers: Teachers = app.state.teachers
    ae = ready_engine(request, teachers.single)
    timeout_s = request_timeout(request, cfg)
    raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s, app.state.body_gate, hold)
    body_read = time.monotonic()
    # several teachers: the body's `model` says which (its JSON object, parsed there, handed on)
    t, obj = (teachers.single, None) if teachers.single else \
        await teachers.pick(raw, app.state.io_pool, name, request.headers.get("x-request-id"))
    info.teacher = t  # (a refusal below is counted under the teacher named)
    ae = ready_engine(request, t)
    m: Metrics = t.metrics
    queue: QueueWait = t.queue_wait  # (each teacher's wait is its own queue over its own throughput)
    loop = asyncio.get_running_loop()
    tok = tokenizer_of(t)
    model = t.engine.served_model_name
    args = (raw, t.limits, model, tok, t.cfg.served_names, request.headers.get("x-request-id"), obj)
    parsed = await loop.run_in_executor(app.state.io_pool, parse, *args) if len(raw) > INLINE_BYTES else parse(*args)
    del raw, args, obj
    reqs: list[ScoreRequest] = parsed.reqs
    # the call's id: the success's line names it as its answer does; a refusal's, only as the client named it
    info.call_id, info.request_id = parsed.request_id, parsed.client_id or info.request_id
    tokens = info.tokens = sum(r.length for r in reqs)
    info.rows = sum(r.rows for r in reqs)
    if tokens > t.cfg.max_queue_tokens:  # could never be admitted: retrying cannot help
        raise BadRequest(f"the prompts hold {tokens} tokens, more than the queue holds "
                         f"(max_queue_tokens={t.cfg.max_queue_tokens})", "prompt")
    if not hold.resize(need := sum(json_held_bytes(r) for r in reqs)):
        raise over_budget(hold, need)
    refuse_long_wait(queue, cfg, min(r.priority for r in reqs))
    deadline = None if timeout_s is None else t0 + timeout_s
    for r in reqs:
        r.deadline = deadline
        r.received, r.body_read = t0, body_read  # (the step trace's clocks of its way in)
    app.state.handling += 1
    for r in reqs:
        queue.admit(r.priority, r.length)
    try:
        tasks = [asyncio.ensure_future(ae.score(r)) for r in reqs]
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        gathered = asyncio.ensure_future(_all_scored(tasks))
        # The engine answers a request past its deadline itself (504); this bound holds when it cannot.
        limit = None if deadline is None else max(deadline - time.monotonic(), 0.0) + _DEADLINE_GRACE_S
        try:
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED, timeout=limit)
        finally:
            watcher.cancel()
            if not gathered.done():
                for t in tasks:
                    t.cancel()  # drops their work and frees their KV
                gathered.cancel()
            left = []
            for r, t in zip(reqs, tasks):
                answered = t.done() and not t.cancelled() and t.exception() is None
                left.append((r.priority, r.length, answered and t.result().error is None,
                             t.result().finished_at if answered else None))
            queue.finish_many(left)  # (every step the batch spanned judged with the batch still queued)
        if not done:
            m.labels(m.failures, reason="timeout").inc()
            return error_response(504, "request deadline exceeded: the engine did not answer in time")
        if gathered not in done:
            raise ClientGone("client disconnected")
        results: list[ScoreResult] = gathered.result()  # (raises a prompt's refusal: the call's)
        info.scored = True  # (the drain's cut-off now waits for the answer being built)
    finally:
        app.state.handling -= 1
    failed = next((r for r in results if r.error is not None), None)
    if failed is not None:
        m.labels(m.failures, reason=failed.error_kind or "internal").inc()
        return error_response(http_status(failed.error_kind), failed.error,
                              headers=retry_after(failed.error_kind))
    for r, res in zip(reqs, results, strict=True):
        observe_scored(m, r, res)
    content = await loop.run_in_executor(app.state.plp_pool, build, parsed, results, model, tok)
    return HeldResponse(content, hold)
