"""Settings and request encoding shared by ``TeacherClient`` and ``AsyncTeacherClient``."""

from __future__ import annotations

import json
from typing import Any

import httpx

from teacher_server import __version__
from teacher_server.client.protocol import TeacherRequest, build_body
from teacher_server.client.retry import RetryPolicy

JSON_HEADERS = {"content-type": "application/json"}


def _timeout(timeout: float | httpx.Timeout) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(timeout, 10.0))  # fail over fast when nobody listens


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"user-agent": f"teacher-server-client/{__version__}"}
    if api_key is not None:
        h["authorization"] = f"Bearer {api_key}"
    return h


class ClientBase:
    """What both clients hold: the server, the retry policy and the connection settings.
    Plain data only: nothing here is bound to a thread or an event loop."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float | httpx.Timeout, max_retries: int,
                 backoff: float, max_backoff: float, max_concurrency: int, model: str | None) -> None:
        assert max_concurrency >= 1, f"max_concurrency must be >= 1, got {max_concurrency}"
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self.retry = RetryPolicy(max_retries, backoff, max_backoff)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client_kw: dict[str, Any] = dict(base_url=self.base_url, headers=_headers(api_key),
                                               timeout=_timeout(timeout), limits=limits)

    def _encode(self, req: TeacherRequest) -> bytes:
        """The request body; raises ValueError/TypeError for bad input before anything is sent."""
        return json.dumps(build_body(req, self.model), separators=(",", ":")).encode()
