"""The servers a client spreads its requests over: several base URLs, or the addresses one DNS
name resolves to (a Kubernetes headless Service: one A record per ready pod).

Requests are routed with the server's own policy (``teacher_server.routing``: same unscored
prefix -> same server, least outstanding tokens otherwise), over the servers that are up. A
server that refuses connections or answers 502/503 is taken out at once; a background thread
probes ``/health`` of every server each ``health_interval`` seconds, takes out those that fail
(a probe that only times out counts from the second in a row: a busy server can be slow to
answer once, and taking it out moves its whole load onto the others) and puts back those that
answer 200 again, and resolves the DNS name again (pods come and go).
Plain data and one daemon thread: shared by the sync and async clients, any thread or loop.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections.abc import Sequence

import httpx

from teacher_server.routing import BLOCK_SIZE, SPILL_TOKENS, Router, Routing

log = logging.getLogger("teacher_server.client")
# Answers that say "this server cannot serve now" (502: a proxy lost it; 503: draining, loading
# or its engine is down), as opposed to 429 (busy: it will serve, later) and 504 (this request
# ran past its deadline).
DOWN_STATUSES = frozenset({502, 503})


def resolve_urls(url: str) -> list[str] | None:
    """``url`` with its host replaced by each address it resolves to (sorted, deduplicated);
    ``[url]`` when it resolves to one address; None when it does not resolve now."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if host is None:
        return [url]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addrs = sorted({info[4][0] for info in infos})
    if len(addrs) <= 1:
        return [url]
    netlocs = [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addrs]
    return [urllib.parse.urlunsplit(parts._replace(netloc=n)) for n in netlocs]


def origin(seed: str, url: str) -> tuple[dict[str, str], dict[str, str]]:
    """(headers, httpx extensions) of a request to ``url``, an address ``seed`` resolved to: the
    name it was reached by as ``Host`` and, over https, as the TLS server name (SNI and the
    certificate check), so a pod's certificate for the Service name verifies; nothing for the
    seed itself."""
    if url == seed:
        return {}, {}
    parts = urllib.parse.urlsplit(seed)
    headers = {"host": parts.netloc.rsplit("@", 1)[-1]}
    return headers, ({"sni_hostname": parts.hostname} if parts.scheme == "https" and parts.hostname else {})


class Endpoints:
    """The servers of a client, their health and their outstanding tokens. ``probe_transport``:
    the ``httpx`` transport of the health probes (TLS settings, tests)."""

    def __init__(self, base_urls: Sequence[str], *, resolve: bool, routing: Routing = "affinity",
                 block_size: int = BLOCK_SIZE, spill_tokens: int = SPILL_TOKENS, health_interval: float = 5.0,
                 headers: dict[str, str] | None = None, probe_transport: httpx.BaseTransport | None = None) -> None:
        if not base_urls:
            raise ValueError("give at least one base URL")
        self.seeds = [u.rstrip("/") for u in base_urls]
        self.resolve = resolve
        self.router = Router(routing, block_size, spill_tokens)
        self.health_interval = health_interval
        self._lock = threading.Lock()
        self._load: dict[str, int] = {}  # url -> outstanding tokens (this client's)
        self._down: set[str] = set()
        self._timeouts: dict[str, int] = {}  # health probes that timed out in a row, by server
        self._resolved: dict[str, list[str]] = {}  # seed -> its addresses at the last resolution that worked
        self._origin: dict[str, tuple[dict[str, str], dict[str, str]]] = {}  # url -> ``origin(seed, url)``
        self._set_urls(self._discover())
        self._probe_kw = dict(headers=headers, timeout=httpx.Timeout(5.0), transport=probe_transport)
        self._watch_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_watch()

    def _start_watch(self) -> None:
        """The health checks' thread (again, after ``close``: a client used after ``async with``)."""
        with self._watch_lock:
            if self._thread is not None:
                return
            self._probe_http = httpx.Client(**self._probe_kw)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="teacher-client-health",
                                            daemon=True)
            self._thread.start()

    # --- routing -----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        with self._lock:
            return sorted(self._load)

    @property
    def up(self) -> list[str]:
        """The servers requests are routed to now."""
        with self._lock:
            return sorted(set(self._load) - self._down)

    def pick(self, key: bytes | None, avoid: str | None = None) -> str:
        """The server for a request with routing key ``key`` (``Router.key``), among those up
        (all of them when none is, so the caller's retries and backoff go on as with one
        server); ``avoid``, the one that just failed, only when it is the only choice."""
        if self._thread is None:
            self._start_watch()
        with self._lock:
            up = {u: n for u, n in self._load.items() if u not in self._down}
            if avoid is not None and len(up) > 1:
                up.pop(avoid, None)
            return self.router.pick(key, up or dict(self._load))

    def begin(self, url: str, tokens: int) -> None:
        with self._lock:
            if url in self._load:
                self._load[url] += tokens

    def end(self, url: str, tokens: int) -> None:
        with self._lock:
            if url in self._load:
                self._load[url] = max(self._load[url] - tokens, 0)

    def mark_down(self, url: str, why: str) -> bool:
        """Take ``url`` out until its health probe passes; True when another server is up."""
        with self._lock:
            if url in self._load and url not in self._down:
                log.warning("teacher server %s taken out: %s", url, why)
                self._down.add(url)
            return bool(set(self._load) - self._down)

    def close(self) -> None:
        """Stop the health checks (they start again if the client is used again)."""
        with self._watch_lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._stop.set()
            thread.join(timeout=10)
            self._probe_http.close()

    # --- discovery and health ----------------------------------------------------------
    def _discover(self) -> list[str]:
        """The servers now: each seed's addresses; a seed that does not resolve this time keeps
        those it had (a DNS blip does not take out every pod), or stands for itself at first."""
        if not self.resolve:
            return list(self.seeds)
        for seed in self.seeds:
            got = resolve_urls(seed)
            if got is not None:
                self._resolved[seed] = got
            elif seed not in self._resolved:
                self._resolved[seed] = [seed]
        with self._lock:
            self._origin.update((u, origin(seed, u)) for seed in self.seeds for u in self._resolved[seed])
        return sorted({u for seed in self.seeds for u in self._resolved[seed]})

    def request_kw(self, url: str) -> tuple[dict[str, str], dict[str, str]]:
        """(headers, extensions) a request to ``url`` needs: see ``origin``."""
        with self._lock:
            return self._origin.get(url, ({}, {}))

    def _set_urls(self, urls: list[str]) -> None:
        with self._lock:
            if not urls:  # resolution failed for now: keep what we have
                return
            for u in set(self._load) - set(urls):
                del self._load[u]
                self._down.discard(u)
                self._timeouts.pop(u, None)
            for u in urls:
                self._load.setdefault(u, 0)

    def _healthy(self, url: str) -> bool | None:
        """True: 200; False: another answer, or no connection; None: the probe timed out."""
        headers, extensions = self.request_kw(url)
        try:
            return self._probe_http.get(url + "/health", headers=headers, extensions=extensions).status_code == 200
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False

    def check(self) -> None:
        """One round: resolve again, probe every server, take out or put back."""
        if self.resolve:
            self._set_urls(self._discover())
        for url in self.urls:
            ok = self._healthy(url)
            with self._lock:
                if url not in self._load:
                    continue
                timeouts = self._timeouts.pop(url, 0)
                if ok is None:
                    self._timeouts[url] = timeouts = timeouts + 1
                    if timeouts == 1:  # the first timeout in a row: not out yet
                        continue
                if ok and url in self._down:
                    log.info("teacher server %s is back", url)
                    self._down.discard(url)
                elif not ok and url not in self._down:
                    log.warning("teacher server %s taken out: health check failed", url)
                    self._down.add(url)

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(self.health_interval):
            try:
                self.check()
            except Exception:  # never let the watcher die: routing would freeze on a stale view
                log.exception("health check round failed")
