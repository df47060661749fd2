"""Settings and request encoding shared by ``TeacherClient`` and ``AsyncTeacherClient``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from teacher_server import __version__
from teacher_server.client.endpoints import Endpoints
from teacher_server.client.protocol import GENERATE_PATH, TeacherRequest, build_body
from teacher_server.client.retry import Attempts, RetryPolicy
from teacher_server.client.urls import normalise_base_url
from teacher_server.routing import BLOCK_SIZE, SPILL_TOKENS, Routing, check_routing, reusable_tokens

JSON_HEADERS = {"content-type": "application/json"}


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
        check_routing(routing)  # (with one URL too: a typo is a typo)
        if not max_concurrency >= 1:  # (a ValueError, not an assert: python -O would drop it, then hang)
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        urls = [normalise_base_url(u) for u in ([base_url] if isinstance(base_url, str) else base_url)]
        if not urls:
            raise ValueError("give at least one base URL")
        self.base_url = urls[0]
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
        return json.dumps(build_body(req, req.model or self.model), separators=(",", ":")).encode()

    def _route_key(self, req: TeacherRequest) -> bytes | None:
        if self.endpoints is None:
            return None
        # a teacher chosen per call: its prefixes are its own (the same tokens share no KV across teachers)
        salt = req.cache_salt if req.model is None else f"{req.model}\0{req.cache_salt or ''}"
        return self.endpoints.router.key(req.token_ids, reusable_tokens(req.start, req.prompt_logprobs), salt)

    def _attempts(self, req: TeacherRequest) -> Attempts:
        """The run of attempts of one request (``Attempts``: both clients' retry loop)."""
        return Attempts(self.retry, self.endpoints, self._route_key(req), len(req.token_ids),
                        expect_scores=req.candidates is not None)

    def _post_args(self, url: str | None) -> tuple[str, dict[str, str], dict[str, str] | None]:
        """The URL, headers and httpx extensions of an attempt to server ``url`` (None: the one
        base URL); a resolved address keeps the name it was reached by (``endpoints.origin``)."""
        if url is None:
            return GENERATE_PATH, JSON_HEADERS, None
        host, extensions = self.endpoints.request_kw(url)
        return url + GENERATE_PATH, ({**JSON_HEADERS, **host} if host else JSON_HEADERS), (extensions or None)
