"""Settings and request encoding shared by ``TeacherClient`` and ``AsyncTeacherClient``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from teacher_server import __version__
from teacher_server.client.endpoints import DOWN_STATUSES, Endpoints
from teacher_server.client.protocol import TeacherRequest, build_body
from teacher_server.client.retry import RetryPolicy
from teacher_server.routing import BLOCK_SIZE, SPILL_TOKENS, Routing, reusable_tokens

JSON_HEADERS = {"content-type": "application/json"}
# Failures that say the server is not there (as opposed to slow: a read timeout is not one).
DOWN_EXCEPTIONS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                   httpx.WriteError)


def _timeout(timeout: float | httpx.Timeout | None) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    # fail over fast when nobody listens; None: no limit but on connecting
    return httpx.Timeout(timeout, connect=10.0 if timeout is None else min(timeout, 10.0))


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"user-agent": f"teacher-server-client/{__version__}"}
    if api_key is not None:
        h["authorization"] = f"Bearer {api_key}"
    return h


class ClientBase:
    """What both clients hold: the servers, the retry policy and the connection settings.
    Plain data only: nothing here is bound to a thread or an event loop.

    One base URL (and ``resolve=False``): every request goes there, as it always has. Several,
    or ``resolve=True`` (the URL's host resolves to one address per server, as a Kubernetes
    headless Service does): ``endpoints`` routes each request (see ``Endpoints``)."""

    def __init__(self, base_url: str | Sequence[str], api_key: str | None, timeout: float | httpx.Timeout | None,
                 max_retries: int, backoff: float, max_backoff: float, max_concurrency: int, model: str | None,
                 *, resolve: bool = False, routing: Routing = "affinity", block_size: int = BLOCK_SIZE,
                 spill_tokens: int = SPILL_TOKENS, health_interval: float = 5.0,
                 probe_transport: httpx.BaseTransport | None = None) -> None:
        assert max_concurrency >= 1, f"max_concurrency must be >= 1, got {max_concurrency}"
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        assert urls, "give at least one base URL"
        self.base_url = urls[0].rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self.retry = RetryPolicy(max_retries, backoff, max_backoff)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client_kw: dict[str, Any] = dict(headers=_headers(api_key), timeout=_timeout(timeout), limits=limits)
        self.endpoints: Endpoints | None = None
        if len(urls) > 1 or resolve:
            self.endpoints = Endpoints(urls, resolve=resolve, routing=routing, block_size=block_size,
                                       spill_tokens=spill_tokens, health_interval=health_interval,
                                       headers=_headers(api_key), probe_transport=probe_transport)
        else:
            self._client_kw["base_url"] = self.base_url

    def _encode(self, req: TeacherRequest) -> bytes:
        """The request body; raises ValueError/TypeError for bad input before anything is sent."""
        return json.dumps(build_body(req, self.model), separators=(",", ":")).encode()

    def _route_key(self, req: TeacherRequest) -> bytes | None:
        if self.endpoints is None:
            return None
        return self.endpoints.router.key(req.token_ids, reusable_tokens(req.start, req.prompt_logprobs),
                                         req.cache_salt)

    def _target(self, url: str) -> tuple[dict[str, str], dict[str, str] | None]:
        """Headers and httpx extensions of a request to server ``url`` (a resolved address keeps
        the name it was reached by: ``endpoints.origin``)."""
        host, extensions = self.endpoints.request_kw(url)
        return ({**JSON_HEADERS, **host} if host else JSON_HEADERS), (extensions or None)

    def _fail_over(self, url: str | None, resp: httpx.Response | None, err: Exception | None) -> bool:
        """After a failed attempt on ``url``: take that server out when it is not there, and
        say whether to go to another one at once (True) rather than after the backoff."""
        if url is None or self.endpoints is None:
            return False
        if isinstance(err, DOWN_EXCEPTIONS):
            return self.endpoints.mark_down(url, f"{type(err).__name__}: {err}")
        if resp is not None and resp.status_code in DOWN_STATUSES:
            return self.endpoints.mark_down(url, f"HTTP {resp.status_code}")
        return False
