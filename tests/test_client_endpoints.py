"""The client's view of several servers: DNS resolution of a headless name, health probes."""

from __future__ import annotations

import socket

import httpx
import pytest

from teacher_server.client.endpoints import Endpoints, resolve_urls

NAME = "teacher-server-headless.ml.svc"


@pytest.fixture
def pods(monkeypatch) -> list[str]:
    """The addresses NAME resolves to (edit the list to add or remove pods)."""
    addrs = ["10.0.0.2", "10.0.0.1", "10.0.0.2"]
    real = socket.getaddrinfo

    def fake(host, port, *args, **kw):
        if host != NAME:
            return real(host, port, *args, **kw)
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
