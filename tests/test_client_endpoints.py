"""The client's view of several servers: DNS resolution of a headless name, health probes."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading

import httpx
import numpy as np
import pytest
from apiutil import npy_b64

from teacher_server.client import TeacherClient
from teacher_server.client.endpoints import Endpoints, resolve_urls

NAME = "teacher-server-headless.ml.svc"


@pytest.fixture
def pods(monkeypatch) -> list[str]:
    """The addresses NAME resolves to (edit the list to add or remove pods; empty: the lookup
    fails, as in a DNS outage)."""
    addrs = ["10.0.0.2", "10.0.0.1", "10.0.0.2"]
    real = socket.getaddrinfo

    def fake(host, port, *args, **kw):
        if host != NAME:
            return real(host, port, *args, **kw)
        if not addrs:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addrs]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return addrs


def test_a_headless_name_is_every_pod_and_is_resolved_again(pods: list[str]) -> None:
    assert resolve_urls(f"http://{NAME}:8000") == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    healthy = {"10.0.0.1", "10.0.0.3"}
    probe = httpx.MockTransport(lambda r: httpx.Response(200 if r.url.host in healthy else 503))
    ep = Endpoints([f"http://{NAME}:8000"], resolve=True, health_interval=3600, probe_transport=probe)
    try:
        assert ep.up == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        pods[:] = ["10.0.0.3", "10.0.0.1", "10.0.0.2"]  # a pod joins; .2 fails its health check
        ep.check()
        assert ep.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
        assert ep.up == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
        assert ep.pick(None) in ep.up  # never routed to a server that is out
        healthy.add("10.0.0.2")
        pods.remove("10.0.0.3")  # a pod leaves; .2 recovers
        ep.check()
        assert ep.up == ep.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    finally:
        ep.close()


def test_a_server_taken_out_on_failure_is_avoided_until_it_is_healthy() -> None:
    urls = ["http://a:1", "http://b:1"]
    up = {"a"}
    probe = httpx.MockTransport(lambda r: httpx.Response(200 if r.url.host in up else 503))
    ep = Endpoints(urls, resolve=False, health_interval=3600, probe_transport=probe)
    try:
        assert ep.mark_down("http://b:1", "connection refused")  # another one is up
        assert {ep.pick(bytes([i]) * 16) for i in range(32)} == {"http://a:1"}
        assert not ep.mark_down("http://a:1", "connection refused")  # none is
        assert ep.pick(None) in urls  # then every server is tried (the caller backs off)
        up.add("b")
        ep.check()
        assert ep.up == ["http://a:1", "http://b:1"]
    finally:
        ep.close()


def test_a_probe_that_times_out_takes_a_server_out_from_the_second_in_a_row() -> None:
    """A busy server may answer one probe late: taking it out would move its whole load onto
    the others. A refusal or a 503 still takes it out at once."""
    state = {"a": "ok", "b": "ok"}

    def answer(r: httpx.Request) -> httpx.Response:
        s = state[r.url.host]
        if s == "slow":
            raise httpx.ReadTimeout("probe timed out", request=r)
        if s == "refused":
            raise httpx.ConnectError("connection refused", request=r)
        return httpx.Response(200 if s == "ok" else 503)

    ep = Endpoints(["http://a:1", "http://b:1"], resolve=False, health_interval=3600,
                   probe_transport=httpx.MockTransport(answer))
    try:
        state["b"] = "slow"
        ep.check()
        assert ep.up == ["http://a:1", "http://b:1"]  # one late answer: still in
        state["b"] = "ok"
        ep.check()
        state["b"] = "slow"
        ep.check()
        assert ep.up == ["http://a:1", "http://b:1"]  # the count starts again after an answer
        ep.check()
        assert ep.up == ["http://a:1"]  # two in a row: out
        ep.check()
        assert ep.up == ["http://a:1"]  # still timing out: stays out
        state["b"] = "ok"
        ep.check()
        assert ep.up == ["http://a:1", "http://b:1"]  # back on its first answer
        for failure in ("refused", "503"):
            state["a"] = failure
            ep.check()
            assert ep.up == ["http://b:1"], failure  # out at once
            state["a"] = "ok"
            ep.check()
    finally:
        ep.close()


def test_a_server_that_leaves_and_comes_back_starts_with_no_timeouts(pods: list[str]) -> None:
    slow = {"10.0.0.2"}

    def answer(r: httpx.Request) -> httpx.Response:
        if r.url.host in slow:
            raise httpx.ReadTimeout("probe timed out", request=r)
        return httpx.Response(200)

    ep = Endpoints([f"http://{NAME}:8000"], resolve=True, health_interval=3600,
                   probe_transport=httpx.MockTransport(answer))
    try:
        ep.check()  # .2's first timeout
        pods[:] = ["10.0.0.1"]
        ep.check()  # it leaves
        pods[:] = ["10.0.0.1", "10.0.0.2"]
        ep.check()  # it is back, and times out once: its count starts again
        assert ep.up == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    finally:
        ep.close()


def test_a_failed_lookup_keeps_the_servers_known(pods: list[str]) -> None:
    """A DNS blip does not replace every pod with the bare name (nor forget which are out)."""
    probe = httpx.MockTransport(lambda r: httpx.Response(503 if r.url.host == "10.0.0.2" else 200))
    ep = Endpoints([f"http://{NAME}:8000"], resolve=True, health_interval=3600, probe_transport=probe)
    try:
        ep.check()
        assert ep.up == ["http://10.0.0.1:8000"]
        pods.clear()
        assert resolve_urls(f"http://{NAME}:8000") is None
        ep.check()
        assert ep.urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"] and ep.up == ["http://10.0.0.1:8000"]
        pods[:] = ["10.0.0.1", "10.0.0.3"]  # back, .2 replaced
        ep.check()
        assert ep.urls == ep.up == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    finally:
        ep.close()
    pods.clear()  # a name that does not resolve at the start stands for itself
    ep = Endpoints([f"http://{NAME}:8000"], resolve=True, health_interval=3600, probe_transport=probe)
    try:
        assert ep.urls == [f"http://{NAME}:8000"]
    finally:
        ep.close()


def test_a_resolved_address_keeps_the_name_it_was_reached_by(pods: list[str]) -> None:
    """Requests to a pod's address carry the Service name as Host and, over https, as the TLS
    server name, so a certificate issued for the name verifies."""
    seen = []

    def answer(r: httpx.Request) -> httpx.Response:
        seen.append((str(r.url), r.headers["host"], r.extensions.get("sni_hostname")))
        return httpx.Response(200)

    ep = Endpoints([f"https://{NAME}:8443"], resolve=True, health_interval=3600,
                   probe_transport=httpx.MockTransport(answer))
    try:
        ep.check()
        assert sorted(seen) == [(f"https://10.0.0.{i}:8443/health", f"{NAME}:8443", NAME) for i in (1, 2)]
        assert ep.request_kw("https://10.0.0.1:8443") == ({"host": f"{NAME}:8443"}, {"sni_hostname": NAME})
    finally:
        ep.close()
    plain = Endpoints([f"http://{NAME}", "http://other:1"], resolve=True, health_interval=3600,
                      probe_transport=httpx.MockTransport(answer))
    try:
        assert plain.request_kw("http://10.0.0.1:80") == ({"host": NAME}, {})
        assert plain.request_kw("http://other:1") == ({}, {})  # reached by its own name
    finally:
        plain.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_pods_behind_one_name_verify_their_certificate(pods: list[str], tmp_path) -> None:
    """End to end over TLS: two servers (127.0.0.1 and 127.0.0.2) with a certificate for the
    Service name only; the client resolves the name, verifies each pod and scores through both."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={NAME}", "-addext", f"subjectAltName=DNS:{NAME}"],
                   check=True, capture_output=True)
    body = json.dumps({"request_id": "x", "model": "m", "created": 0,
                       "choices": [{"index": 0, "token_ids": [], "finish_reason": "length", "logprobs": None}],
                       "prompt_token_id_logprobs": npy_b64(np.zeros((2, 1), np.float32))}).encode()
    hits: dict[str, int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # quiet
            pass

        def _answer(self, payload: bytes) -> None:
            hits[self.server.server_address[0]] = hits.get(self.server.server_address[0], 0) + 1
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            self._answer(b'{"status":"ready"}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self._answer(body)

    servers, port = [], 0
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    for ip in ("127.0.0.1", "127.0.0.2"):
        srv = http.server.ThreadingHTTPServer((ip, port), Handler)
        port = srv.server_address[1]
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    pods[:] = ["127.0.0.1", "127.0.0.2"]
    verify = ssl.create_default_context(cafile=str(cert))
    try:
        with TeacherClient(f"https://{NAME}:{port}", resolve=True, routing="round_robin", max_retries=0,
                           transport=httpx.HTTPTransport(verify=verify), health_interval=3600) as c:
            c.endpoints.check()
            assert len(c.endpoints.up) == 2  # both pods verified by the health probe
            for _ in range(4):
                assert c.score([1, 2, 3], [4]).shape == (2, 1)
        assert hits.get("127.0.0.1", 0) >= 2 and hits.get("127.0.0.2", 0) >= 2
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
