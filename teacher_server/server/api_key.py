"""The API key: ``Authorization: Bearer KEY`` on every path but the open ones."""

from __future__ import annotations

import hmac
import logging
import os
import time
import uuid

from fastapi import FastAPI

from teacher_server.config import Config, sendable_api_key
from teacher_server.server.responses import error_response, request_id_header, scope_request_id

access_log = logging.getLogger("teacher_server.access")
# the scoring endpoints: a refusal there is also counted in the request metrics, as their own refusals are
SCORING_PATHS = frozenset({"/inference/v1/generate", "/v1/completions", "/generate"})


def route_path(scope: dict) -> str:
    """The path the app routes (uvicorn puts ``--root-path`` in front of ``scope["path"]``)."""
    path, root = scope["path"], scope.get("root_path") or ""
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but the open ones; constant-time compare;
    several Authorization headers are refused (400), whatever they hold.
    Pure ASGI (no BaseHTTPMiddleware) so client disconnects still reach the handlers."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:  # noqa: ANN001
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and route_path(scope) not in self.open_paths:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) > 1:  # a proxy or an audit log reading the first would disagree with a check of the last
                await self._refuse(scope, receive, send, 400, "more than one Authorization header: send exactly one")
                return
            if not hmac.compare_digest(given[0] if given else b"", self.expected):
                await self._refuse(scope, receive, send, 401, "invalid or missing API key")
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:  # noqa: ANN001
        """The error answer, on the access line (an operator sees a trainer's mistyped key) and,
        on a scoring path, in the request metrics (``reason="unauthorized"``)."""
        t0 = time.monotonic()
        rid = scope_request_id(scope) or f"score-{uuid.uuid4().hex}"  # one of ours, so the caller can quote it
        await error_response(status, message, headers=request_id_header(rid))(scope, receive, send)
        path = route_path(scope)
        m = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
        if path in SCORING_PATHS and m is not None:  # (every counted request is timed too)
            m.labels(m.requests, status=str(status)).inc()
            m.labels(m.failures, reason="unauthorized").inc()
            m.labels(m.e2e).observe(time.monotonic() - t0)
        access_log.info("%s %s -> %d reason=%s", path[:128], rid[:128], status, message,
                        extra={"request_id": rid[:128], "status": status, "reason": message, "path": path[:128]})


def add_api_key(app: FastAPI, cfg: Config) -> None:
    """Guard ``app`` with the configured key, if there is one (``/health`` and ``/metrics``
    stay open as the config says)."""
    open_paths = {"/health", "/livez"} if cfg.auth_exempt_health else set()
    if cfg.auth_exempt_metrics:
        open_paths.add("/metrics")
    # ``Config.load`` reads TEACHER_SERVER_API_KEY like every setting's variable, under the flag
    # (``--api-key none`` turns it off); a Config made without it falls back to the variable.
    from_env = None if "api_key" in cfg.model_fields_set else os.environ.get("TEACHER_SERVER_API_KEY")
    api_key = cfg.api_key or ((sendable_api_key(from_env) or None) if from_env else None)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
