"""The HTTP server: a thin FastAPI layer over AsyncEngine.

``create_app(config)`` builds the app; the engine is created in the lifespan and lives
in ``app.state``. Validation errors are 400 in vLLM's error shape (never FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from teacher_server import __version__, b64
from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind
from teacher_server.replicas.pool import engine_elsewhere
from teacher_server.server import parsing
from teacher_server.server.errors import HTTP_STATUS, http_status
from teacher_server.server.http import BodyGate, ClientGone, read_body
from teacher_server.server.lifecycle import start_engine, stop_engine, terminate_self
from teacher_server.server.metrics import Metrics
from teacher_server.server.protocol import ErrorResponse, GenerateRequest, GenerateResponse
from teacher_server.server.replica_lifecycle import start_replicas
from teacher_server.server.responses import error_body, error_response, generate_body, header_safe, scope_request_id
from teacher_server.validation import BadRequest

log = logging.getLogger("teacher_server.server")
access_log = logging.getLogger("teacher_server.access")


def create_app(cfg: Config, engine_factory: Callable[[Config], Engine] = Engine,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """Build the service. The engine is built in the background once the app starts, so the
    port answers at once (`/health` is 503 `{"status": "loading"}` until the engine is ready).
    ``on_fatal`` runs when the engine cannot start or cannot recover (default: SIGTERM to this
    process, so the orchestrator restarts it)."""
    elsewhere = engine_elsewhere(cfg)  # the engine(s) in processes of their own
    if not b64.fast():  # a server dependency; without it every .npy body costs ~5 ms of the GIL
        log.warning("pybase64 is not installed: base64 .npy payloads go through the standard library, "
                    "several times slower (pip install 'teacher-server[server]')")

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        st = app.state
        st.metrics = Metrics(cfg.served_name, vllm_names=cfg.vllm_metric_names, replicas=cfg.data_parallel_size)
        st.aengine, st.engine, st.status, st.started = None, None, "loading", int(time.time())
        st.loop = asyncio.get_running_loop()
        st.cutoff = asyncio.Event()  # set when shutdown stops waiting for in-flight requests
        st.handling = 0  # requests handed to the engine whose answer is not written yet (the drain waits for them)
        st.body_gate = BodyGate(cfg.body_read_slots)
        st.io_pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="teacher-io")
        # classic prompt_logprobs bodies (up to tens of MB, seconds of work) are built on their
        # own thread, so one of them does not hold up the parsing of every other request
        st.plp_pool = ThreadPoolExecutor(1, thread_name_prefix="teacher-plp")
        # One replica: the engine runs here, on a thread of this process (no extra hop), unless
        # engine_process (on by default for one GPU). Several: a process each, behind a routing front
        # (teacher_server.replicas).
        start = start_replicas if elsewhere else start_engine
        start(app, cfg, engine_factory, on_step=lambda e, results: st.metrics.observe_engine(e.stats()),
              on_fatal=lambda exc: _on_fatal(app, exc, on_fatal), on_start_failure=on_fatal)
        try:
            yield
        finally:
            await stop_engine(app, cfg)
            st.io_pool.shutdown(wait=False)
            st.plp_pool.shutdown(wait=False)

    app = FastAPI(title="teacher-server", version=__version__, lifespan=lifespan,
                  description="Teacher log-probs of student candidates for on-policy distillation "
                              "(vLLM teacher-scoring compatible).")

    # --- errors --------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(400, *parsing.pydantic_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {}) | _request_id_header(request.headers.get("x-request-id"))  # 405: Allow
        return error_response(exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error")

    # --- auth + body limit ---------------------------------------------------------------
    open_paths = {"/health"} if cfg.auth_exempt_health else set()
    if cfg.auth_exempt_metrics:
        open_paths.add("/metrics")
    # ``Config.load`` reads TEACHER_SERVER_API_KEY like every setting's variable, under the flag
    # (``--api-key none`` turns it off); a Config made without it falls back to the variable.
    from_env = None if "api_key" in cfg.model_fields_set else os.environ.get("TEACHER_SERVER_API_KEY")
    api_key = cfg.api_key or from_env or None

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))

    # --- routes --------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        """200 `{"status": "ready"}` when the engine (every replica) can serve; 503 with `status`
        "loading", "draining" or "failed" (and the error shape, naming a replica that is down)
        otherwise."""
        st = request.app.state
        ae: AsyncEngine | None = st.aengine
        # (a replica pool stays `alive` while one replica serves; a down replica sets fatal_error)
        if ae is not None and ae.alive and ae.accepting and ae.fatal_error is None:
            return Response(b'{"status":"ready"}', media_type="application/json")
        status = st.status if ae is None else ("failed" if not ae.alive or ae.fatal_error else "draining")
        message = {"loading": "engine is loading", "draining": "server is shutting down"}.get(
            status, (ae.fatal_error if ae is not None else None) or "engine failed to start")
        return _json(503, {"status": status, **error_body(503, message)})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models", responses={503: {"model": ErrorResponse}})
    async def models(request: Request) -> Response:
        e: Engine | None = request.app.state.engine
        if e is None:
            return error_response(503, "engine is loading", headers=_retry_after(ErrorKind.UNAVAILABLE))
        return _json(200, {"object": "list", "data": [{
            "id": e.served_model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "teacher-server", "root": str(e.model_dir), "max_model_len": e.max_model_len}]})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        m: Metrics = request.app.state.metrics
        if not elsewhere and request.app.state.engine is not None:  # replicas send theirs
            m.observe_gauges(request.app.state.engine.stats())
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/inference/v1/generate", response_model=GenerateResponse,
              responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                         404: {"model": ErrorResponse}, 408: {"model": ErrorResponse},
                         413: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
                         503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}})
    async def generate(request: Request) -> Response:
        """Score `token_ids`: one prefill, no sampling. Returns the teacher's log-probs of the
        candidates as a base64 `.npy` float32 [rows, K] matrix, rows = len(token_ids) - 1 - start.
        `X-Request-Id` names the request when the body has no `request_id`; the response
        carries the request's id in `X-Request-Id`."""
        t0 = time.monotonic()
        st = request.app.state
        m: Metrics = st.metrics
        info = _RequestInfo(request.headers.get("x-request-id"))
        work = asyncio.ensure_future(_generate(request, cfg, t0, info))
        cutoff = asyncio.ensure_future(st.cutoff.wait())
        try:
            await asyncio.wait({work, cutoff}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and info.scored:  # its result is in: the answer is being built, not dropped
                await asyncio.wait({work})
        except BaseException:  # this handler was cancelled (the server's own shutdown): so is its work
            work.cancel()
            raise
        finally:
            cutoff.cancel()
        if work.done():
            resp = work.result()
        else:  # shutdown stopped waiting: drop the work (frees its KV) and say so
            work.cancel()
            m.labels(m.failures, reason="shutdown").inc()
            resp = error_response(503, "server shut down before the request finished; retry on another replica",
                                  headers=_retry_after(ErrorKind.UNAVAILABLE))
        dt = time.monotonic() - t0
        m.labels(m.requests, status=str(resp.status_code)).inc()
        m.labels(m.e2e).observe(dt)
        resp.headers.update(_request_id_header(info.request_id))
        rid = (info.request_id or "-")[:128]
        access_log.info("generate %s -> %d tokens=%d rows=%d %.3fs", rid, resp.status_code, info.tokens, info.rows,
                        dt, extra={"request_id": rid, "status": resp.status_code, "latency_s": round(dt, 4),
                                   "tokens": info.tokens, "rows": info.rows})
        return resp

    _register_schemas(app)
    return app


class _RequestInfo:
    """What the access line reports about a request, filled in as it is learnt."""

    def __init__(self, header_request_id: str | None) -> None:
        self.header_request_id = header_request_id
        self.request_id = header_request_id
        self.tokens = 0
        self.rows = 0
        self.admitted = False  # handed to the engine (counted in ``app.state.handling``)
        self.scored = False  # the engine's result is in


def _request_id_header(rid: str | None) -> dict[str, str]:
    """The response's ``X-Request-Id`` for a request's id (none without one)."""
    return {"X-Request-Id": header_safe(rid)} if rid is not None else {}


_DEADLINE_GRACE_S = 1.0  # past a request's deadline, before the front answers for an engine that has not
_RETRY_AFTER_S = {ErrorKind.OVERLOADED: "1", ErrorKind.UNAVAILABLE: "5"}


def _retry_after(kind: ErrorKind | None) -> dict[str, str]:
    """``Retry-After`` for the errors a retry can get past: a full queue (429), a drain (503)."""
    return {"Retry-After": _RETRY_AFTER_S[kind]} if kind in _RETRY_AFTER_S else {}


def _json(status: int, obj: dict) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but the open ones; constant-time compare.
    Pure ASGI (no BaseHTTPMiddleware) so client disconnects still reach the handlers."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:  # noqa: ANN001
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                answer = error_response(401, "invalid or missing API key",
                                        headers=_request_id_header(scope_request_id(scope)))
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _generate(request: Request, cfg: Config, t0: float, info: _RequestInfo) -> Response:
    try:
        return await _generate_counted(request, cfg, t0, info)
    finally:
        if info.admitted:  # counted at admission (``app.state.handling``), uncounted on every way out
            request.app.state.handling -= 1


async def _generate_counted(request: Request, cfg: Config, t0: float, info: _RequestInfo) -> Response:
    app = request.app
    m: Metrics = app.state.metrics
    engine: Engine | None = app.state.engine
    ae: AsyncEngine | None = app.state.aengine
    try:
        if ae is None:
            raise EngineUnavailable("engine is loading")
        if not ae.accepting or not ae.alive:
            raise EngineUnavailable("server is shutting down" if ae.alive else ae.fatal_error)
        coding = request.headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise BadRequest(f"Content-Encoding {coding[:40]!r} is not supported: send the JSON body uncompressed")
        raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s, app.state.body_gate)
        # Parsing and validating a large body takes a while: keep it off the event loop.
        args = (raw, app.state.limits, engine.served_model_name, info.header_request_id)
        body, req = await asyncio.get_running_loop().run_in_executor(app.state.io_pool, parsing.parse_request, *args) \
            if len(raw) > _INLINE_BYTES else parsing.parse_request(*args)
        info.request_id, info.tokens, info.rows = req.request_id, req.length, req.rows
        if req.length > cfg.max_queue_tokens:  # could never be admitted: retrying cannot help
            raise BadRequest(f"token_ids has {req.length} tokens, more than the queue holds "
                             f"(max_queue_tokens={cfg.max_queue_tokens})", "token_ids")
        if cfg.request_timeout_s is not None:
            req.deadline = t0 + cfg.request_timeout_s
        info.admitted = True
        app.state.handling += 1
        task = asyncio.ensure_future(ae.score(req))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        # The engine answers a request past its deadline itself (504) between steps; this bound
        # holds when it cannot (a step that does not end: a hung GPU or worker).
        limit = None if req.deadline is None else max(req.deadline - time.monotonic(), 0.0) + _DEADLINE_GRACE_S
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED, timeout=limit)
        finally:
            watcher.cancel()
            if not task.done():  # cancelled from outside (shutdown), the client went away, or the deadline
                task.cancel()
        if not done:
            m.labels(m.failures, reason="timeout").inc()
            return error_response(504, "request deadline exceeded (request_timeout_s): the engine did not "
                                       "answer in time")
        if task not in done:  # the client went away: drop its work and free its KV
            raise ClientGone("client disconnected")
        res = task.result()
        info.scored = True
    except BadRequest as e:
        info.request_id = e.request_id or info.request_id
        m.labels(m.failures, reason={400: "validation", 404: "unknown_model", 408: "body_timeout"}.get(
            e.status, "too_large")).inc()
        return error_response(e.status, e.message, e.param)
    except ClientGone as e:
        m.labels(m.failures, reason="disconnected").inc()
        return error_response(499, str(e))  # nobody reads it; the access line records it
    except (EngineOverloaded, EngineUnavailable) as e:
        m.labels(m.failures, reason=e.kind.value).inc()
        return error_response(HTTP_STATUS[e.kind], str(e), headers=_retry_after(e.kind))
    if res.error is not None:  # (a replica's full queue or drain comes back as a result: Retry-After too)
        m.labels(m.failures, reason=res.error_kind or "internal").inc()
        return error_response(http_status(res.error_kind), res.error, headers=_retry_after(res.error_kind))
    m.labels(m.queue_time).observe(max(res.scheduled_at - req.arrival, 0.0) if res.scheduled_at else 0.0)
    if res.scheduled_at:
        m.labels(m.inference_time).observe(max(res.finished_at - res.scheduled_at, 0.0))
    m.labels(m.prompt_tokens).inc(req.length)
    m.labels(m.scored_rows).inc(req.rows if req.candidates is not None else 0)
    build = lambda: generate_body(req, res, engine.served_model_name, bool(body.return_token_ids))  # noqa: E731
    pool = app.state.plp_pool if req.prompt_logprobs is not None else \
        app.state.io_pool if req.rows * max(req.k, 1) > _INLINE_BYTES // 4 else None
    content = await asyncio.get_running_loop().run_in_executor(pool, build) if pool is not None else build()
    return Response(content, media_type="application/json")


_INLINE_BYTES = 256 * 1024  # bodies and results above this are (de)serialised in a worker thread
# Threads for that work. It holds the GIL (orjson, base64, numpy on small arrays), so more
# threads parse no faster, and each runnable one takes a share of the GIL from the engine
# thread, whose kernel launches must keep the GPU fed: with asyncio's default pool (up to 32
# threads) a burst of large requests starved the GPU for seconds.
_IO_THREADS = 1


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has gone. The body has been read, so the server's next ASGI
    message for this request is ``http.disconnect``, sent when the connection closes: waiting
    for it costs nothing while the request waits, where polling ``is_disconnected`` ran a
    cancelled receive four times a second per waiting request on the event loop (small each
    time, ~10 us measured, but work that shares the GIL with the engine thread)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.25)  # (no server sends more of a body it has finished; never busy-wait)


def _on_fatal(app: FastAPI, exc: BaseException, hook: Callable[[], None] | None) -> None:
    """The engine cannot recover: report unhealthy and ask the process to exit so the
    orchestrator restarts it."""
    m: Metrics = app.state.metrics
    if m.replicas == 1:  # a replica that went down has already marked its own series
        m.set_healthy(False)
    app.state.exit_code = 3
    log.critical("engine failed (%s); exiting", exc)
    (hook or terminate_self)()


def _register_schemas(app: FastAPI) -> None:
    """Put the request model's nested schemas into components (the body is read by hand)."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        full = GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in full.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault("GenerateRequest", full)
        body = schema["paths"]["/inference/v1/generate"]["post"]["requestBody"]
        body["content"]["application/json"]["schema"] = {"$ref": "#/components/schemas/GenerateRequest"}
        return schema

    app.openapi = openapi
