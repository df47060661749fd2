"""The HTTP server: a thin FastAPI layer over AsyncEngine.

``create_app(config)`` builds the app; the engine is created in the lifespan and lives
in ``app.state``. Validation errors are 400 in vLLM's error shape (never FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from teacher_server import __version__, b64
from teacher_server.client.tokenizer import tokenizer_identity
from teacher_server.config import Config
from teacher_server.did_you_mean import did_you_mean
from teacher_server.engine.async_engine import AsyncEngine
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind
from teacher_server.replicas.pool import engine_elsewhere
from teacher_server.server import parsing
from teacher_server.server.admission import QueueWait
from teacher_server.server.api_key import add_api_key
from teacher_server.server.batch_scoring import handle_scoring
from teacher_server.server.byte_budget import ByteBudget
from teacher_server.server.completions import CompletionRequest, build_completion, parse_completion
from teacher_server.server.docs_page import add_docs_page
from teacher_server.server.errors import retry_after
from teacher_server.server.generate import IO_THREADS, handle_generate
from teacher_server.server.http import BodyGate
from teacher_server.server.lifecycle import on_engine_fatal, start_engine, stop_engine
from teacher_server.server.metrics import Metrics
from teacher_server.server.openapi import register_schemas
from teacher_server.server.protocol import ErrorResponse, GenerateRequest, GenerateResponse
from teacher_server.server.replica_lifecycle import start_replicas
from teacher_server.server.responses import error_body, error_response, json_response, request_id_header
from teacher_server.server.sglang_generate import SGLangGenerateRequest, build_sglang, parse_sglang
from teacher_server.server.teacher_set import Teachers
from teacher_server.server.teacher_start import start_teachers, teachers_health

log = logging.getLogger("teacher_server.server")


def _model_permission(created: int) -> dict:
    """vLLM's ``ModelPermission`` as its model list writes it (OpenAI's old shape, read by clients
    that parse the whole card)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def create_app(cfg: Config, engine_factory: Callable[[Config], Engine] = Engine,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """Build the service. The engine is built in the background once the app starts, so the
    port answers at once (`/health` is 503 `{"status": "loading"}` until the engine is ready).
    ``on_fatal`` runs when the engine cannot start or cannot recover (default: SIGTERM to this
    process, so the orchestrator restarts it)."""
    cfgs = cfg.teacher_configs()  # one (`cfg`, or a `teachers` list's one entry), or one per teacher
    elsewhere = engine_elsewhere(cfgs[0])  # the engine(s) in processes of their own
    if not b64.fast():  # a server dependency; without it every .npy body costs ~5 ms of the GIL
        log.warning("pybase64 is not installed: base64 .npy payloads go through the standard library, "
                    "several times slower (pip install 'teacher-server[server]')")

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        st = app.state
        st.metrics = Metrics(cfgs[0].served_name, vllm_names=cfg.vllm_metric_names,
                             replicas=cfgs[0].data_parallel_size,
                             replica_label=None if len(cfgs) == 1 else any(c.data_parallel_size > 1 for c in cfgs))
        st.aengine, st.engine, st.status, st.started = None, None, "loading", int(time.time())
        st.loop = asyncio.get_running_loop()
        st.cutoff = asyncio.Event()  # set when shutdown stops waiting for in-flight requests
        st.handling = 0  # requests handed to the engine whose answer is not written yet (the drain waits for them)
        st.body_gate = BodyGate(cfg.body_read_slots)
        st.byte_budget = ByteBudget(cfg.max_inflight_bytes)
        st.queue_wait = QueueWait(cfg.max_queue_wait_s)
        st.io_pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="teacher-io")
        # classic prompt_logprobs bodies (up to tens of MB, seconds of work) are built on their
        # own thread, so one of them does not hold up the parsing of every other request
        st.plp_pool = ThreadPoolExecutor(1, thread_name_prefix="teacher-plp")
        # One replica: the engine runs here, on a thread of this process (no extra hop), unless
        # engine_process (on by default for one GPU). Several: a process each, behind a routing front
        # (teacher_server.replicas).
        st.teachers = Teachers(st, cfgs, st.metrics)
        if len(cfgs) == 1:
            start = start_replicas if elsewhere else start_engine
            start(app, cfgs[0], engine_factory, on_step=lambda e, results: st.metrics.observe_engine(e.stats()),
                  on_fatal=lambda exc: on_engine_fatal(app, exc, on_fatal), on_start_failure=on_fatal)
        else:
            start_teachers(app, st.teachers.all, engine_factory, on_fatal)
        try:
            yield
        finally:
            await stop_engine(app, cfg)
            st.io_pool.shutdown(wait=False)
            st.plp_pool.shutdown(wait=False)

    # /docs is our own page (server/docs_page.py): FastAPI's loads Swagger UI from a CDN (blank offline)
    # (no redirect for a path with a trailing slash: a bare 307 a client does not follow; a 404 naming the path)
    app = FastAPI(title="teacher-server", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False,
                  description="Teacher log-probs of student candidates for on-policy distillation "
                              "(vLLM teacher-scoring compatible).")

    # --- errors --------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(400, *parsing.pydantic_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {}) | request_id_header(request.headers.get("x-request-id"))  # 405: Allow
        detail = str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":  # no such route: say which, and the nearest one
            path = request.url.path[:200]
            routes = sorted({r.path for r in app.routes if isinstance(getattr(r, "path", None), str)})
            detail = f"no route {request.method} {path}{did_you_mean(path, routes)}"
        return error_response(exc.status_code, detail, headers=headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error")

    add_api_key(app, cfg)
    if cfg.allowed_origins:  # outermost, so a browser's preflight OPTIONS is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    # --- routes --------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"], responses={503: {"model": ErrorResponse}})  # (HEAD: probes)
    async def health(request: Request) -> Response:
        """200 `{"status": "ready"}` when the engine (every replica) can serve; 200
        `{"status": "degraded", "replicas_serving", "replicas", "message"}` while some replicas
        serve and others are down or restarting; 503 with `status` "loading", "draining" or
        "failed" (and the error shape, naming what is down) when none can serve. With several
        teachers (`teachers`), the same per teacher under `teachers`, and 503 when any teacher
        cannot serve at all (docs/teachers.md)."""
        st = request.app.state
        if st.teachers.single is None:
            return teachers_health(st)
        ae: AsyncEngine | None = st.aengine
        serving, total = ae.capacity if ae is not None else (0, 1)
        if ae is not None and ae.alive and ae.accepting and serving > 0:
            if serving == total:
                return Response(b'{"status":"ready"}', media_type="application/json")
            return json_response(200, {"status": "degraded", "replicas_serving": serving, "replicas": total,
                                       "message": ae.fatal_error or f"{total - serving} replica(s) not serving"})
        status = st.status if ae is None else ("failed" if not ae.alive or serving == 0 else "draining")
        message = {"loading": "engine is loading", "draining": "server is shutting down"}.get(
            status, (ae.fatal_error if ae is not None else None) or "engine failed to start")
        return json_response(503, {"status": status, **error_body(503, message)})

    @app.api_route("/livez", methods=["GET", "HEAD"])
    async def livez(request: Request) -> Response:
        """200 `{"status": <as /health's>}` whenever this process answers: loading, a replica
        restarting, draining. For a liveness probe, which must not restart the process while
        it recovers by itself (an engine that cannot recover makes the process exit 3)."""
        return json_response(200, {"status": orjson.loads((await health(request)).body)["status"]})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models", responses={503: {"model": ErrorResponse}})
    async def models(request: Request) -> Response:
        """The served model (vLLM's shape) with its `vocab_size` (the embedding's rows: valid ids
        are `[0, vocab_size)`) and `tokenizer`, the identity of the checkpoint's tokenizer files
        (`{"sha256", "source"}`, null without them), so a student can check that it shares the
        teacher's tokenizer (`teacher_server.client.check_tokenizer`)."""
        st = request.app.state
        if st.engine is None:
            return error_response(503, "engine is loading", headers=retry_after(ErrorKind.UNAVAILABLE))
        data = []
        for t in st.teachers.all:  # each teacher, in the configuration's order
            e: Engine = t.engine
            if not hasattr(t, "tokenizer_identity"):  # read once (a tokenizer.json is megabytes), off the event loop
                t.tokenizer_identity = await asyncio.to_thread(tokenizer_identity, e.model_dir)
            data.append({"id": e.served_model_name, "object": "model", "created": st.started,
                         "owned_by": "teacher-server", "root": str(e.model_dir), "parent": None,
                         "max_model_len": e.max_model_len, "permission": [_model_permission(int(time.time()))],
                         "vocab_size": t.limits.vocab_size, "tokenizer": t.tokenizer_identity})
        return json_response(200, {"object": "list", "data": data})

    @app.get("/metrics", response_class=PlainTextResponse)  # (Prometheus' text format)
    async def metrics_endpoint(request: Request) -> Response:
        m: Metrics = request.app.state.metrics
        for t in request.app.state.teachers.all:
            if not engine_elsewhere(t.cfg) and t.engine is not None:  # replicas send theirs
                t.metrics.observe_gauges(t.engine.stats())
        teachers = request.app.state.teachers.all
        m.observe_front(request.app.state.byte_budget, teachers[0].queue_wait)
        for t in teachers[1:]:  # (each teacher's estimated wait; the bytes in flight are the service's)
            t.metrics.labels(t.metrics.queue_wait).set(t.queue_wait.estimated_wait_s)
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
        return await handle_generate(request, cfg)

    @app.post("/v1/completions", responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                                            429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": CompletionRequest.model_json_schema()}}}})
    async def completions(request: Request) -> Response:
        """vLLM's OpenAI `/v1/completions` for teacher scoring: token-id prompts (or a batch, or
        text with a tokenizer), `max_tokens` 0/1, `echo`, `prompt_logprobs`, `logprobs`,
        `return_tokens_as_token_ids`; vLLM's response and error shapes (see docs/trainers.md)."""
        return await handle_scoring(request, cfg, "completions", parse_completion, build_completion)

    @app.put("/generate", include_in_schema=False)  # (SGLang's route takes PUT as POST)
    @app.post("/generate", responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                                      429: {"model": ErrorResponse},
                                      503: {"model": ErrorResponse}},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": SGLangGenerateRequest.model_json_schema()}}}})
    async def sglang_generate(request: Request) -> Response:
        """SGLang's native `/generate` for teacher scoring: `input_ids`, `return_logprob`,
        `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob`, `max_new_tokens` 0/1;
        SGLang's `meta_info` (see docs/trainers.md). With several teachers, `model` names one
        (404 for an unknown one)."""
        return await handle_scoring(request, cfg, "sglang-generate", parse_sglang, build_sglang)

    register_schemas(app)
    add_docs_page(app)
    return app
