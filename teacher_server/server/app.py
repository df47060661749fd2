"""The HTTP server: a thin FastAPI layer over AsyncEngine.

``create_app(config)`` builds the app; the engine is created in the lifespan and lives
in ``app.state``. Validation errors are 400 in vLLM's error shape (never FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import logging
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from contextlib import asynccontextmanager

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from teacher_server import __version__
from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreResult, prompt_logprob_entries
from teacher_server.engine.stats import EngineStats
from teacher_server.server.errors import HTTP_STATUS, http_status
from teacher_server.server.metrics import Metrics
from teacher_server.server.protocol import ErrorResponse, GenerateRequest, GenerateResponse
from teacher_server.validation import STREAM_MESSAGE, BadRequest, Limits, build_request

log = logging.getLogger("teacher_server.server")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestEntityTooLarge",
                429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError",
                503: "ServiceUnavailableError", 504: "TimeoutError"}
NEG_INF_JSON = -9999.0  # JSON has no infinity; vLLM clients expect this value


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def encode_npy(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr, dtype="<f4"), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _finite(x: float) -> float:
    return NEG_INF_JSON if not math.isfinite(x) else x


def format_prompt_logprobs(req_tokens: np.ndarray, res: ScoreResult) -> list:
    """JSON form: ``{token id: {logprob, rank, decoded_token}}`` per entry, -inf as -9999.0."""
    return [None if e is None else {str(t): {"logprob": _finite(v), "rank": r, "decoded_token": None}
                                    for t, v, r in e}
            for e in prompt_logprob_entries(req_tokens, res)]


def create_app(cfg: Config, engine_factory: Callable[[Config], Engine] = Engine,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """Build the service. The engine is made in the lifespan (startup), not at import.
    ``on_fatal`` runs when the engine cannot recover (default: SIGTERM to this process, so
    the orchestrator restarts it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        # Built in the engine thread itself: per-thread GPU state made at start-up (cuDNN's
        # plan cache, filled by the attention warm-up) is then the one the steps use.
        ae = await AsyncEngine.build(lambda: engine_factory(cfg), cfg.max_queue_requests, cfg.max_queue_tokens,
                                     on_step=lambda e, results: _on_step(app.state.metrics, e, results),
                                     on_fatal=lambda exc: _on_fatal(app, exc, on_fatal))
        app.state.aengine = ae
        app.state.io_pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="teacher-io")
        try:
            engine = ae.engine
            metrics = Metrics(engine.served_model_name)
            app.state.engine = engine
            app.state.metrics = metrics
            app.state.limits = Limits(engine.spec.vocab_size, engine.max_model_len, cfg.max_logprobs,
                                      cfg.max_rows_x_k)
            app.state.started = int(time.time())
            metrics.labels(metrics.healthy).set(1)
            yield
        finally:
            ae.stop_accepting()
            if ae.in_flight:
                log.info("draining %d in-flight request(s) (timeout %.0fs)", ae.in_flight, cfg.shutdown_timeout_s)
                drained = await ae.drain(cfg.shutdown_timeout_s)
                if not drained:
                    log.warning("shutdown timeout: %d request(s) still in flight", ae.in_flight)
            ae.shutdown()
            app.state.io_pool.shutdown(wait=False)

    app = FastAPI(title="teacher-server", version=__version__, lifespan=lifespan,
                  description="Teacher log-probs of student candidates for on-policy distillation "
                              "(vLLM teacher-scoring compatible).")

    # --- errors --------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _pydantic_error(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error")

    # --- auth + body limit ---------------------------------------------------------------
    open_paths = {"/health"} if cfg.auth_exempt_health else set()
    if cfg.auth_exempt_metrics:
        open_paths.add("/metrics")
    api_key = cfg.api_key or os.environ.get("TEACHER_SERVER_API_KEY") or None

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))

    # --- routes --------------------------------------------------------------------------
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        """200 when the engine can serve, 503 otherwise (starting, draining or failed)."""
        ae: AsyncEngine | None = getattr(request.app.state, "aengine", None)
        if ae is None or not ae.alive or not ae.accepting:
            return error_response(503, "engine is not ready" if ae is None or ae.alive else ae.fatal_error or "down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        e: Engine = request.app.state.engine
        return {"object": "list", "data": [{
            "id": e.served_model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "teacher-server", "root": str(e.model_dir), "max_model_len": e.max_model_len}]}

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        m: Metrics = request.app.state.metrics
        _refresh_gauges(m, request.app.state.engine)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/inference/v1/generate", response_model=GenerateResponse,
              responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                         404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
                         429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}})
    async def generate(request: Request) -> Response:
        """Score `token_ids`: one prefill, no sampling. Returns the teacher's log-probs of the
        candidates as a base64 `.npy` float32 [rows, K] matrix, rows = len(token_ids) - 1 - start."""
        t0 = time.monotonic()
        m: Metrics = request.app.state.metrics
        resp = await _generate(request, cfg, t0)
        dt = time.monotonic() - t0
        m.labels(m.requests, status=str(resp.status_code)).inc()
        m.labels(m.e2e).observe(dt)
        rid = str(getattr(request.state, "request_id", None))[:128]
        level = logging.DEBUG if resp.status_code < 400 else (logging.WARNING if resp.status_code >= 500 else logging.INFO)
        log.log(level, "generate %s -> %d in %.3fs", rid, resp.status_code, dt,
                extra={"request_id": rid, "status": resp.status_code, "latency_s": round(dt, 4)})
        return resp

    _register_schemas(app)
    return app


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but the open ones; constant-time compare.
    Pure ASGI (no BaseHTTPMiddleware) so client disconnects still reach the handlers."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:  # noqa: ANN001
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await error_response(401, "invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(part)
    return b"".join(chunks)


async def _generate(request: Request, cfg: Config, t0: float) -> Response:
    app = request.app
    m: Metrics = app.state.metrics
    engine: Engine = app.state.engine
    ae: AsyncEngine = app.state.aengine
    try:
        if not ae.accepting or not ae.alive:
            raise EngineUnavailable("server is shutting down" if ae.alive else ae.fatal_error)
        raw = await _read_body(request, cfg.max_body_bytes)
        # Parsing and validating a large body takes a while: keep it off the event loop.
        args = (raw, app.state.limits, engine.served_model_name)
        body, req = await asyncio.get_running_loop().run_in_executor(app.state.io_pool, _parse_request, *args) \
            if len(raw) > _INLINE_BYTES else _parse_request(*args)
        request.state.request_id = req.request_id
        if req.length > cfg.max_queue_tokens:  # could never be admitted: retrying cannot help
            raise BadRequest(f"token_ids has {req.length} tokens, more than the queue holds "
                             f"(max_queue_tokens={cfg.max_queue_tokens})", "token_ids")
        if cfg.request_timeout_s is not None:
            req.deadline = t0 + cfg.request_timeout_s
        task = asyncio.ensure_future(ae.score(req))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task not in done:  # the client went away: drop its work and free its KV
            task.cancel()
            m.labels(m.failures, reason="disconnected").inc()
            return error_response(499, "client disconnected")
        res = task.result()
    except BadRequest as e:
        m.labels(m.failures, reason={400: "validation", 404: "unknown_model"}.get(e.status, "too_large")).inc()
        return error_response(e.status, e.message, e.param)
    except EngineOverloaded as e:
        m.labels(m.failures, reason="overloaded").inc()
        return error_response(HTTP_STATUS[e.kind], str(e), headers={"Retry-After": "1"})
    except EngineUnavailable as e:
        m.labels(m.failures, reason="unavailable").inc()
        return error_response(HTTP_STATUS[e.kind], str(e), headers={"Retry-After": "5"})
    if res.error is not None:
        m.labels(m.failures, reason=res.error_kind or "internal").inc()
        return error_response(http_status(res.error_kind), res.error)
    m.labels(m.queue_time).observe(max(res.scheduled_at - req.arrival, 0.0) if res.scheduled_at else 0.0)
    if res.scheduled_at:
        m.labels(m.inference_time).observe(max(res.finished_at - res.scheduled_at, 0.0))
    m.labels(m.prompt_tokens).inc(req.length)
    m.labels(m.scored_rows).inc(req.rows if req.candidates is not None else 0)
    big = req.rows * max(req.k, 1) > _INLINE_BYTES // 4 or req.prompt_logprobs is not None
    build = lambda: orjson.dumps(_response_body(body, req, res, engine.served_model_name))  # noqa: E731
    content = await asyncio.get_running_loop().run_in_executor(app.state.io_pool, build) if big else build()
    return Response(content, media_type="application/json")


_INLINE_BYTES = 256 * 1024  # bodies and results above this are (de)serialised in a worker thread
# Threads for that work. It holds the GIL (orjson, base64, numpy on small arrays), so more
# threads parse no faster, and each runnable one takes a share of the GIL from the engine
# thread, whose kernel launches must keep the GPU fed: with asyncio's default pool (up to 32
# threads) a burst of large requests starved the GPU for seconds.
_IO_THREADS = 1


def _parse_request(raw: bytes, limits: Limits, served_model_name: str):  # noqa: ANN202
    """JSON bytes -> (GenerateRequest, ScoreRequest); BadRequest (400/404) otherwise."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        body = GenerateRequest.model_validate(obj)
    except ValidationError as e:
        raise BadRequest(*_pydantic_message(e.errors())) from None
    if body.model is not None and body.model != served_model_name:
        raise BadRequest(f"model {body.model[:200]!r} does not exist; this server serves {served_model_name!r}",
                         "model", status=404)
    if body.stream:
        raise BadRequest(STREAM_MESSAGE, "stream")
    sp = body.sampling_params
    req = build_request(
        token_ids=body.token_ids, limits=limits, candidates=sp.prompt_logprob_token_ids,
        start=sp.prompt_logprob_start, prompt_logprobs=sp.prompt_logprobs, max_tokens=sp.max_tokens,
        request_id=body.request_id, cache_salt=body.cache_salt, priority=body.priority,
        truncate_prompt_tokens=sp.truncate_prompt_tokens)
    return body, req


def _response_body(body: GenerateRequest, req, res: ScoreResult, model_name: str) -> dict:  # noqa: ANN001
    mt = req.max_tokens
    out = {
        "request_id": req.request_id,
        "model": model_name,
        "created": int(time.time()),
        "choices": [{"index": 0, "token_ids": [res.next_token] if mt and res.next_token is not None else [],
                     "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": req.length, "completion_tokens": mt, "total_tokens": req.length + mt,
                  "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
        "prompt_logprobs": format_prompt_logprobs(req.token_ids, res) if req.prompt_logprobs is not None else None,
        "prompt_token_id_logprobs": encode_npy(res.token_id_logprobs) if res.token_id_logprobs is not None else None,
    }
    if body.return_token_ids:
        out["prompt_token_ids"] = req.token_ids.tolist()
    return out


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _pydantic_error(errors: list) -> Response:
    return error_response(400, *_pydantic_message(errors))


def _pydantic_message(errors: list) -> tuple[str, str | None]:
    e = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in e.get("loc", ()) if p not in ("body",)]
    # Drop union-branch markers pydantic adds (e.g. 'list[int]'), keep field names and indices.
    loc = [p for p in loc if not ("[" in p or p in ("str", "int", "bool", "float"))]
    param = ".".join(p for p in loc if not p.isdigit()) or None
    where = ".".join(loc) or "body"
    msg = str(e.get("msg", "invalid value"))
    if e.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif e.get("type") == "missing":
        msg = "field required"
    return f"{where}: {msg}"[:500], param


def _refresh_gauges(m: Metrics, engine: Engine, s: EngineStats | None = None) -> None:
    s = s or engine.stats()
    m.labels(m.waiting).set(s.waiting)
    m.labels(m.running).set(s.running)
    m.labels(m.kv_usage).set(s.kv_usage)


def _totals(s: EngineStats, m: Metrics) -> list[tuple[object, float]]:
    """(counter, the engine's running total that feeds it)."""
    t = s.timing
    return [(m.labels(m.stage_seconds, stage=stage), v) for stage, v in t.stages().items()] + [
        (m.labels(m.gpu_seconds, kind="busy"), t.gpu_s), (m.labels(m.gpu_seconds, kind="idle"), t.gpu_idle_s),
        (m.labels(m.computed_tokens), s.computed_tokens), (m.labels(m.prefix_queries), s.prefix_query_tokens),
        (m.labels(m.prefix_hits), s.prefix_hit_tokens)]


def _on_step(m: Metrics, engine: Engine, results: list[ScoreResult]) -> None:
    m.labels(m.steps).inc()
    s = engine.stats()
    last = getattr(m, "_last_totals", None)
    now = _totals(s, m)
    for i, (counter, total) in enumerate(now):  # counters fed from the engine's running totals
        d = total - (last[i] if last else 0)
        if d > 0:
            counter.inc(d)
    m._last_totals = [v for _, v in now]
    _refresh_gauges(m, engine, s)


def _on_fatal(app: FastAPI, exc: BaseException, hook: Callable[[], None] | None) -> None:
    """The engine cannot recover: report unhealthy and ask the process to exit so the
    orchestrator restarts it."""
    m: Metrics = app.state.metrics
    m.labels(m.healthy).set(0)
    app.state.exit_code = 3
    log.critical("engine failed (%s); exiting", exc)
    if hook is not None:
        hook()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


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
