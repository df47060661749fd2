"""The API key: ``Authorization: Bearer KEY`` on every path but the open ones."""

from __future__ import annotations

import hmac
import os

from fastapi import FastAPI

from teacher_server.config import Config
from teacher_server.server.responses import error_response, request_id_header, scope_request_id


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but the open ones; constant-time compare;
    several Authorization headers are refused (400), whatever they hold.
    Pure ASGI (no BaseHTTPMiddleware) so client disconnects still reach the handlers."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:  # noqa: ANN001
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) > 1:  # a proxy or an audit log reading the first would disagree with a check of the last
                answer = error_response(400, "more than one Authorization header: send exactly one",
                                        headers=request_id_header(scope_request_id(scope)))
                await answer(scope, receive, send)
                return
            if not hmac.compare_digest(given[0] if given else b"", self.expected):
                answer = error_response(401, "invalid or missing API key",
                                        headers=request_id_header(scope_request_id(scope)))
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_api_key(app: FastAPI, cfg: Config) -> None:
    """Guard ``app`` with the configured key, if there is one (``/health`` and ``/metrics``
    stay open as the config says)."""
    open_paths = {"/health"} if cfg.auth_exempt_health else set()
    if cfg.auth_exempt_metrics:
        open_paths.add("/metrics")
    # ``Config.load`` reads TEACHER_SERVER_API_KEY like every setting's variable, under the flag
    # (``--api-key none`` turns it off); a Config made without it falls back to the variable.
    from_env = None if "api_key" in cfg.model_fields_set else os.environ.get("TEACHER_SERVER_API_KEY")
    api_key = cfg.api_key or from_env or None
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
