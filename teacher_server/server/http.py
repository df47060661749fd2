"""The HTTP edge: uvicorn's settings, a bound on the time to send headers, and reading a
request body under the size limit and the body deadline."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import socket
import ssl
import uuid
from collections.abc import AsyncIterator

import h11
import orjson
import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from teacher_server.config import Config, ConfigError
from teacher_server.server.byte_budget import BODY_FACTOR, CHUNKED_FACTOR, Hold, over_budget
from teacher_server.server.framing import OneFraming
from teacher_server.server.responses import error_body, header_safe, scope_request_id
from teacher_server.validation import BadRequest

log = logging.getLogger("teacher_server.server")
access_log = logging.getLogger("teacher_server.access")


class ClientGone(Exception):
    """The client closed the connection before its request was answered."""


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving a request's line and headers
    (slow-header clients would otherwise hold a connection forever): the timer starts when
    the connection opens or, on a kept-alive connection, when the next request's first bytes
    arrive, and stops when the headers are complete. On expiry the connection is closed.

    And one on the way back: a client that reads none of its answer for ``send_timeout_s``
    (the connection's write buffer full the whole time: a stopped trainer, a zero TCP window)
    has its connection aborted, so the answer's bytes, counted in the in-flight byte budget
    until they are handed to the connection, are freed rather than held for good."""

    header_timeout_s: float = 10.0
    send_timeout_s: float = 60.0

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot frame (a malformed request line or header, contradictory
        lengths): the 400 in the documented JSON error shape, then the connection closes
        (uvicorn's own answer is plain text)."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer already went out (a 503 before
            self.transport.close()  # the body was read, then a bad chunk): no second one, just close
            return
        body = orjson.dumps(error_body(400, "invalid HTTP request: malformed request line, headers or framing"))
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]
        # the headers were read (the body's framing failed): the id they gave; else one of ours
        rid = self._framed_request_id() or f"score-{uuid.uuid4().hex}"
        head.append((b"x-request-id", header_safe(rid).encode()))
        access_log.info("%s -> 400 reason=invalid HTTP request: %s", rid[:128], msg[:200],
                        extra={"request_id": rid[:128], "status": 400, "reason": f"invalid HTTP request: {msg[:200]}"})
        for event in (h11.Response(status_code=400, headers=head, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _framed_request_id(self) -> str | None:
        """The X-Request-Id of the request being read, when its headers were framed (or refused
        for two framings, ``OneFraming``)."""
        if self.cycle is None or self.cycle.response_complete:
            return getattr(self.conn, "refused_request_id", None)
        return scope_request_id(self.cycle.scope)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.conn = OneFraming(self.conn)  # type: ignore[assignment]
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        self._disarm_send_timer()
        super().resume_writing()

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timeout(self) -> None:
        self._send_timer = None  # (the write buffer stayed full: resume_writing disarms the timer)
        rid = self._framed_request_id() or "-"
        log.info("aborting a connection whose client read none of its answer (%s) within %.0fs (send_timeout_s)",
                 rid[:128], self.send_timeout_s)
        self.transport.abort()  # (close() would wait for the buffer to drain: for ever)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers within %.0fs",
                     self.header_timeout_s)
            self.transport.close()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._arm_header_timer()  # the first bytes of a request on a kept-alive connection
        super().data_received(data)
        if not self._waiting_for_headers():  # a new request cycle started: headers are complete
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_send_timer()
        super().connection_lost(exc)


# An idle kept-alive connection is closed after this long. Longer than clients keep idle
# connections (httpx: 5 s, the same as uvicorn's default): with equal limits a client may send
# its next request on a connection the server is closing at that moment, and gets a read error
# with no response (seen under load when a client's loop is slow to reuse its connections).
KEEP_ALIVE_S = 30


def check_port_free(host: str, port: int, setting: str = "port") -> None:
    """ConfigError naming the port when it cannot be bound (another server holds it), with
    how to pick another (``setting``: the one that gives it); bound as uvicorn binds
    (SO_REUSEADDR), then released at once."""
    flag, var = "--" + setting.replace("_", "-"), "TEACHER_SERVER_" + setting.upper()
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ConfigError(f"host {host!r} does not resolve ({e.strerror}): give --host an address of this "
                              f"machine (0.0.0.0: all of them; 127.0.0.1: this machine only)") from None
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"host {host} is not an address of this machine ({e.strerror}): give --host one of "
                                  f"its addresses (0.0.0.0: all of them; 127.0.0.1: this machine only)") from None
            if e.errno == errno.EACCES:
                raise ConfigError(f"port {port} on {host} needs privileges this process lacks ({e.strerror}): pick "
                                  f"a port from 1024 up with {flag} N") from None
            raise ConfigError(f"port {port} on {host} is not free ({e.strerror}): another process listens there; "
                              f"pick another with {flag} N (or {var}=N), or stop that process") from None


def uvicorn_config(app: FastAPI, cfg: Config, host: str | None = None, port: int | None = None,
                   **kw: object) -> uvicorn.Config:
    """uvicorn settings of the service (the CLI and the tests serve through this)."""
    protocol = type("TeacherHTTPProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": cfg.header_timeout_s,
                                                                      "send_timeout_s": cfg.send_timeout_s})
    for name in ("ssl_keyfile", "ssl_certfile"):  # a clear line now, not uvicorn's traceback at bind time
        path = getattr(cfg, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}: no file {path}")
    if cfg.ssl_keyfile and cfg.ssl_certfile:  # loaded as uvicorn will load them
        try:
            # (no password: an encrypted key fails here, rather than prompt on the terminal)
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile,
                                                                                password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"ssl_certfile {cfg.ssl_certfile} and ssl_keyfile {cfg.ssl_keyfile} do not load as a PEM "
                              f"certificate and its private key, unencrypted ({e}): check both files") from None
    tls = {"ssl_keyfile": cfg.ssl_keyfile, "ssl_certfile": cfg.ssl_certfile} if cfg.ssl_keyfile else {}
    return uvicorn.Config(app, host=host or cfg.host, port=cfg.port if port is None else port, http=protocol,
                          log_config=None, access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                          **{"root_path": cfg.root_path, **tls, **kw})


class BodyGate:
    """First come, first read: at most ``slots`` large request bodies are read at a time.

    Under a burst of uploads (a trainer posting a batch of 1 MB requests at once) every body
    would otherwise arrive interleaved with all the others, and the first whole request would
    reach the engine only when most of the burst's bytes had: the GPU idles meanwhile. Read a
    few at a time, the first ones are whole almost at once and the rest follow in order, in
    about the same total time (the bodies a connection is not reading wait in its socket: TCP
    holds their senders back). A body waits at most ``max_wait_s`` for a slot and then reads
    anyway, so slow senders holding the slots cannot hold the others back for long. The wait
    does not count towards ``body_timeout_s``. Small bodies (under ``LARGE`` bytes declared)
    do not queue; chunked ones (size unknown) do."""

    LARGE = 256 * 1024

    def __init__(self, slots: int, max_wait_s: float = 0.25) -> None:
        self.slots, self.max_wait_s = slots, max_wait_s
        self._free = slots
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    def _release(self) -> None:
        while self._waiting:  # hand the slot to the oldest waiter still waiting
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    @contextlib.asynccontextmanager
    async def turn(self, declared: int | None) -> AsyncIterator[None]:
        """Hold a slot (or give up waiting for one after ``max_wait_s``) while reading."""
        if self.slots <= 0 or (declared is not None and declared < self.LARGE):
            yield
            return
        held = False
        if self._free > 0 and not self._waiting:
            self._free -= 1
            held = True
        else:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            try:
                await asyncio.wait({fut}, timeout=self.max_wait_s)  # leaves fut alone on timeout
            except BaseException:  # cancelled (shutdown): pass on a slot handed over meanwhile
                if fut.done() and not fut.cancelled():
                    self._release()
                else:
                    fut.cancel()
                raise
            if fut.done():  # handed a slot (possibly just as the wait ran out)
                held = True
            else:  # waited long enough: read without a slot
                fut.cancel()
        try:
            yield
        finally:
            if held:
                self._release()


# A declared body of SLOW_BODY_FROM bytes or more holds twice its size of the byte budget before
# its first byte (so that a burst of large bodies is refused early rather than all half read):
# after a grace, it must keep arriving at SLOW_BODY_MIN_RATE on average, or it is a 408. Idle
# connections declaring large bodies cannot hold the budget for body_timeout_s (a lock-out of
# every other request: eight of 128 MiB take the 2 GiB default).
SLOW_BODY_FROM = 16 << 20
SLOW_BODY_GRACE_S = 5.0
SLOW_BODY_MIN_RATE = 1 << 20


def is_json_media(content_type: str) -> bool:
    """``application/json`` or ``application/*+json`` (parameters such as a charset aside): the
    types a browser cannot send across origins without asking first, so a web page cannot make
    a visitor's browser post scoring work here (vLLM's server refuses other types too)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int, timeout_s: float, gate: BodyGate | None = None,
                    hold: Hold | None = None) -> bytes | bytearray:
    """The whole body, at most ``limit`` bytes (413) and within ``timeout_s`` (408) of its
    turn at ``gate``; a client that goes away meanwhile raises ClientGone. A declared
    Content-Length above the limit is refused before reading; a chunked body's size is enforced
    while reading (a request giving both framings never gets here: ``OneFraming``). ``hold``
    takes the body's share of the in-flight byte budget: ``BODY_FACTOR`` bytes per byte, all
    before reading, when the size is declared; ``CHUNKED_FACTOR`` per byte as the bytes arrive
    when it is not; OverBudget when it does not fit (the rest of the body is then never read)."""
    media = request.headers.get("content-type")
    if media is not None and not is_json_media(media):  # (none given: read as JSON, as FastAPI does)
        raise BadRequest(f"Content-Type {media[:100]!r} is not JSON: send the body with Content-Type: "
                         f"application/json", status=415)
    declared = request.headers.get("content-length")
    chunked = "transfer-encoding" in request.headers
    size = int(declared) if not chunked and declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise BadRequest(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
    hold = hold or Hold(None)
    if size is not None and not hold.take(BODY_FACTOR * size):
        raise over_budget(hold, hold.n + BODY_FACTOR * size)

    async def receive_declared() -> bytearray:
        # Straight into one buffer of the declared size (HTTP framing holds the body to it): no
        # list of parts and no joined copy beside it, whose freed parts would stay resident in
        # the allocator's arenas (measured: 2.85 x the body at the peak, against 2 this way).
        buf, got = bytearray(size), 0
        parts = request.stream().__aiter__()
        t0 = asyncio.get_running_loop().time()
        while True:
            try:
                if size < SLOW_BODY_FROM:
                    part = await parts.__anext__()
                else:  # its reservation is held only while the body keeps coming
                    left = t0 + SLOW_BODY_GRACE_S + got / SLOW_BODY_MIN_RATE - asyncio.get_running_loop().time()
                    part = await asyncio.wait_for(parts.__anext__(), max(left, 0.0))
            except StopAsyncIteration:
                return buf
            except asyncio.TimeoutError:
                raise BadRequest(f"request body of {size} bytes arriving slower than {SLOW_BODY_MIN_RATE >> 20} MiB/s "
                                 f"(after {SLOW_BODY_GRACE_S:g}s): its share of the byte budget is given back",
                                 status=408) from None
            buf[got:got + len(part)] = part
            got += len(part)

    async def receive_chunked() -> bytes:
        chunks, got = [], 0
        async for part in request.stream():
            got += len(part)
            if got > limit:
                raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413)
            if not hold.take(CHUNKED_FACTOR * len(part)):
                raise over_budget(hold, hold.n + CHUNKED_FACTOR * len(part))
            chunks.append(part)
        return b"".join(chunks)

    # the gate's turn: chunked bodies (size unknown until read) queue; with neither header there
    # is no body (HTTP/1.1)
    turn = gate.turn(size if size is not None or chunked else 0) if gate is not None else contextlib.nullcontext()
    try:
        async with turn:
            return await asyncio.wait_for(receive_declared() if size is not None else receive_chunked(), timeout_s)
    except ClientDisconnect:
        raise ClientGone("client disconnected while sending the body") from None
    except asyncio.TimeoutError:
        raise BadRequest(f"request body not received within {timeout_s:g}s (body_timeout_s)", status=408) from None

