"""Operations: limits, backpressure, cancellation, deadlines, auth, metrics, SIGTERM drain,
fault isolation, structured logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from apiutil import assert_error, body, decode
from conftest import LiveServer, free_port, wait_healthy, wait_until
from engine_util import fail_on_token

from teacher_server.config import Config
from teacher_server.engine.engine import Engine

GEN = "/inference/v1/generate"
ROOT = Path(__file__).resolve().parents[1]


def demo_cfg(tmp_path_factory, **kw) -> Config:
    base = dict(demo_model_dir=str(tmp_path_factory.mktemp("demo") / "m"), device="cpu",
                max_num_batched_tokens=256, num_kv_blocks=2048, max_model_len=8192, max_logprobs=64)
    return Config(**(base | kw))


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def long_body(n: int = 6000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return body(rng.integers(0, 4096, n), [1, 2, 3], start=10)


# --- auth ---------------------------------------------------------------------------------

def test_api_key(tmp_path_factory, caplog) -> None:
    caplog.set_level(logging.INFO, logger="teacher_server.access")
    with LiveServer(demo_cfg(tmp_path_factory, api_key="s3cret")) as s, s.client() as c:
        good = body([1, 2, 3, 4], [5, 6])
        assert_error(c.post(GEN, json=good), 401)
        assert_error(c.post(GEN, json=good, headers={"Authorization": "Bearer EMPTY"}), 401)
        assert_error(c.post(GEN, json=good, headers={"Authorization": "s3cret"}), 401)
        assert_error(c.get("/v1/models"), 401)
        refused = c.post(GEN, json=good, headers={"X-Request-Id": "trace-401"})
        assert_error(refused, 401)
        assert refused.headers["X-Request-Id"] == "trace-401"  # the caller's id, refused or not
        two = c.post("/v1/completions", json={"prompt": [1, 2]}, headers=[("Authorization", "Bearer s3cret")] * 2)
        assert_error(two, 400, contains="more than one Authorization")
        assert c.post(GEN, json=good, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/livez").status_code == 200  # open by default
        text = c.get("/metrics").text
        # the refusals on the scoring paths are counted as their own refusals are; /v1/models is only logged
        assert metric(text, "teacher_server_requests_total", status="401") == 4
        assert metric(text, "teacher_server_requests_total", status="400") == 1
        assert metric(text, "teacher_server_request_failures_total", reason="unauthorized") == 5
        assert metric(text, "teacher_server_requests_total", status="200") == 1
    lines = [r for r in caplog.records if r.name == "teacher_server.access" and r.status in (400, 401)]
    assert [(r.path, r.status) for r in lines] == [(GEN, 401)] * 3 + [("/v1/models", 401), (GEN, 401),
                                                                        ("/v1/completions", 400)]
    assert "reason=invalid or missing API key" in lines[0].getMessage()
    assert lines[4].request_id == "trace-401" and lines[0].request_id.startswith("score-")
    assert all(r.getMessage().startswith(r.path) for r in lines)
    with LiveServer(demo_cfg(tmp_path_factory, api_key="k", auth_exempt_health=False,
                             auth_exempt_metrics=False)) as s, s.client() as c:
        assert_error(c.get("/health"), 401)
        assert_error(c.get("/livez"), 401)
        assert_error(c.get("/metrics"), 401)
        assert c.get("/health", headers={"Authorization": "Bearer k"}).status_code == 200
    # behind a proxy that strips a prefix (uvicorn puts root_path in front of the path the key reads)
    with LiveServer(demo_cfg(tmp_path_factory, api_key="k", root_path="/p")) as s, s.client() as c:
        assert c.get("/health").status_code == 200
        assert_error(c.post(GEN, json=body([1, 2, 3], [4])), 401)
        assert metric(c.get("/metrics").text, "teacher_server_request_failures_total", reason="unauthorized") == 1


def test_a_body_that_is_not_json_by_its_content_type_is_415(demo_server) -> None:
    """A browser posts text/plain and form types across origins without asking first: a web
    page could make its visitors' browsers send scoring work. Those types are refused on every
    scoring endpoint; JSON's (with a charset, or +json) and none at all are read."""
    import json

    payloads = {GEN: body([1, 2, 3, 4], [5, 6]), "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 0,
                                                                     "prompt_logprobs": 1},
                "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}}
    failures = "teacher_server_request_failures_total"
    with demo_server.client() as c:
        before = c.get("/metrics").text
        for path, payload in payloads.items():
            raw = json.dumps(payload).encode()
            for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                r = c.post(path, content=raw, headers={"content-type": media})
                assert_error(r, 415, contains="application/json")
                assert r.json()["error"]["type"] == "UnsupportedMediaType"
            for media in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
                r = c.post(path, content=raw, headers={"content-type": media} if media else {})
                assert r.status_code == 200, (path, media, r.text)
        after = c.get("/metrics").text  # counted as what they are (they had been counted as too_large)
        assert metric(after, failures, reason="unsupported_media_type") - metric(
            before, failures, reason="unsupported_media_type") == 9
        assert metric(after, failures, reason="too_large") == metric(before, failures, reason="too_large")


# --- limits --------------------------------------------------------------------------------

def test_body_limit_and_rows_x_k(tmp_path_factory) -> None:
    with LiveServer(demo_cfg(tmp_path_factory, max_body_bytes=1 << 20, max_rows_x_k=1000)) as s, s.client() as c:
        big = body(list(range(1, 4000)) * 60)  # ~ 1.3 MB
        assert_error(c.post(GEN, json=big), 413, contains="exceeds")

        def chunks():  # no Content-Length: the limit holds while streaming
            for _ in range(300):
                yield b" " * 8192
        assert_error(c.post(GEN, content=chunks(), headers={"content-type": "application/json"}), 413)
        assert_error(c.post(GEN, json=body(range(500), [1, 2, 3])), 400, contains="rows*K")
        assert c.post(GEN, json=body(range(100), [1, 2, 3])).status_code == 200


def test_hundred_megabyte_body(demo_server) -> None:
    payload = b'{"token_ids": [' + b"1234," * (20 * 1024 * 1024) + b"1]}"  # 100 MB
    with demo_server.client() as c:
        r = c.post(GEN, content=payload, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500
        assert_error(r, r.status_code)
        assert c.get("/health").status_code == 200


# --- backpressure ---------------------------------------------------------------------------

def test_overload_gets_429_and_accepted_requests_complete(tmp_path_factory) -> None:
    cfg = demo_cfg(tmp_path_factory, max_queue_requests=3, max_num_batched_tokens=128)
    bodies = [long_body(800, seed=i) for i in range(24)]
    with LiveServer(cfg) as s:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as c:
                return await asyncio.gather(*(c.post(GEN, json=b) for b in bodies))

        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        for r in rs:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert_error(r, 429)
        with s.client() as c:
            for b, r in zip(bodies, rs):
                if r.status_code == 200:
                    alone = decode(c.post(GEN, json=b).json()["prompt_token_id_logprobs"])
                    np.testing.assert_allclose(decode(r.json()["prompt_token_id_logprobs"]), alone, atol=2e-5)
            m = c.get("/metrics").text
            assert metric(m, "teacher_server_request_failures_total", reason="overloaded") == codes.count(429)


# --- cancellation and deadlines ---------------------------------------------------------------

def test_disconnect_frees_the_request(tmp_path_factory) -> None:
    cfg = demo_cfg(tmp_path_factory, max_num_batched_tokens=64, enable_prefix_caching=False)
    with LiveServer(cfg) as s:
        with httpx.Client(base_url=s.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post(GEN, json=long_body(8000))
        with s.client() as c:
            deadline = time.time() + 30
            while time.time() < deadline:
                m = c.get("/metrics").text
                if metric(m, "teacher_server_request_failures_total", reason="disconnected") >= 1:
                    break
                time.sleep(0.1)
            assert metric(m, "teacher_server_request_failures_total", reason="disconnected") == 1
            engine: Engine = s.app.state.engine
            deadline = time.time() + 10
            while time.time() < deadline and (engine.stats().active_requests or engine.stats().kv_blocks_used):
                time.sleep(0.05)
            stats = engine.stats()
            assert stats.active_requests == 0 and stats.kv_blocks_used == 0  # removed and its KV freed
            assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200


def test_waiting_requests_are_not_polled(tmp_path_factory, monkeypatch) -> None:
    """A request waiting for the engine costs the front nothing: its disconnect comes as the
    connection's ``http.disconnect`` message, not from polling ``Request.is_disconnected``
    four times a second. The disconnect test above shows the message still frees a request
    whose client has gone."""
    from starlette.requests import Request

    calls = []
    original = Request.is_disconnected

    async def counted(self) -> bool:
        calls.append(1)
        return await original(self)

    monkeypatch.setattr(Request, "is_disconnected", counted)
    cfg = demo_cfg(tmp_path_factory, max_num_batched_tokens=64, enable_prefix_caching=False)
    with LiveServer(cfg) as s, s.client() as c:
        t = time.monotonic()
        assert c.post(GEN, json=long_body(3000)).status_code == 200  # ~50 steps of 64 tokens
        assert time.monotonic() - t > 0.3  # it waited: a polling front would have polled
    assert not calls


def test_deadline(tmp_path_factory) -> None:
    # 8000 tokens at 16 a step: 500 steps, several times the deadline on any CPU; the deadline
    # itself long enough for the small request after it
    cfg = demo_cfg(tmp_path_factory, request_timeout_s=2.0, max_num_batched_tokens=16)
    with LiveServer(cfg) as s, s.client() as c:
        assert_error(c.post(GEN, json=long_body(8000)), 504, contains="deadline")
        assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200
        assert s.app.state.engine.stats().kv_blocks_used == 0


# --- metrics ----------------------------------------------------------------------------------

def test_metrics_names(demo_server) -> None:
    with demo_server.client() as c:
        for _ in range(2):
            assert c.post(GEN, json={**body(list(range(1, 60)), [1, 2], start=40), "cache_salt": "m"}).status_code == 200
        c.post(GEN, json={"token_ids": []})
        m = c.get("/metrics").text
    for name in ("teacher_server_num_requests_waiting", "teacher_server_num_requests_running",
                 "teacher_server_prompt_tokens_total", "teacher_server_scored_rows_total",
                 "teacher_server_e2e_request_latency_seconds_bucket", "teacher_server_request_queue_time_seconds_bucket",
                 "teacher_server_request_inference_time_seconds_bucket", "teacher_server_kv_cache_usage_perc",
                 "teacher_server_prefix_cache_queries_total", "teacher_server_prefix_cache_hits_total",
                 "teacher_server_request_failures_total", "teacher_server_requests_total",
                 "teacher_server_engine_gpu_seconds_total"):
        assert name in m, name
    assert metric(m, "teacher_server_prefix_cache_hits_total") >= 32
    assert metric(m, "teacher_server_engine_stage_seconds_total", stage="launch") > 0
    assert metric(m, "teacher_server_engine_stage_seconds_total", stage="prepare") > 0
    assert metric(m, "teacher_server_engine_gpu_seconds_total", kind="busy") == 0  # CPU: no GPU timeline
    assert metric(m, "teacher_server_engine_gpu_seconds_total", kind="idle") == 0
    # every token the engine ran is counted once (all requests have been answered)
    assert metric(m, "teacher_server_computed_tokens_total") == demo_server.app.state.engine.stats().computed_tokens > 0
    assert metric(m, "teacher_server_request_failures_total", reason="validation") >= 1
    # the capacity the engine was given: the fixture's budget and pool
    stats = demo_server.app.state.engine.stats()
    assert metric(m, "teacher_server_token_budget") == stats.token_budget == 512
    assert metric(m, "teacher_server_kv_cache_tokens") == stats.kv_tokens_total == 4096 * 16
    # which kernels the warm-up left on: every switch exported, none on the CPU
    from teacher_server.ops.fused import SWITCHES

    assert [k for k, _ in stats.kernels] == list(SWITCHES) and not any(on for _, on in stats.kernels)
    for kernel in SWITCHES:
        assert f'kernel="{kernel}"' in m, kernel
        assert metric(m, "teacher_server_kernel_enabled", kernel=kernel) == 0


# --- fault isolation ---------------------------------------------------------------------------

POISON = 4095


def faulty_engine(exc_factory):
    def factory(cfg: Config) -> Engine:
        eng = Engine(cfg)
        fail_on_token(eng, POISON, exc_factory)
        return eng
    return factory


@pytest.mark.parametrize("exc", [lambda: RuntimeError("injected step failure"),
                                 lambda: torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")])
def test_step_failure_fails_only_that_step(tmp_path_factory, exc) -> None:
    cfg = demo_cfg(tmp_path_factory)
    with LiveServer(cfg, engine_factory=faulty_engine(exc)) as s, s.client() as c:
        good = body([1, 2, 3, 4, 5], [7, 8], start=1)
        before = c.post(GEN, json=good).json()["prompt_token_id_logprobs"]
        r = c.post(GEN, json=body([POISON, 2, 3], [7]))
        assert_error(r, 500, contains="inference failed")
        assert c.get("/health").status_code == 200
        assert c.post(GEN, json=good).json()["prompt_token_id_logprobs"] == before
        assert s.app.state.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(("message", "fatal"), [
    ("CUDA error: an illegal memory access was encountered", True),
    ("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", True),
    ("cuDNN error: CUDNN_STATUS_MAPPING_ERROR", True),
    ("Triton Error [CUDA]: unspecified launch failure", True),
    ("Triton Error [CUDA]: out of memory", False),  # memory, not a broken context
    ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", False),  # can be about a shape
    ("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error", True),
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", False),  # about a shape: that step fails, the engine goes on
    ("injected step failure", False),
])
def test_which_step_errors_end_the_engine(message: str, fatal: bool) -> None:
    from teacher_server.engine.fatal import is_fatal

    assert is_fatal(RuntimeError(message)) is fatal
    assert not is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory. CUDA error"))


def test_unrecoverable_failure_turns_unhealthy(tmp_path_factory) -> None:
    fired = threading.Event()
    cfg = demo_cfg(tmp_path_factory)
    factory = faulty_engine(lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with LiveServer(cfg, engine_factory=factory, on_fatal=fired.set) as s, s.client() as c:
        assert_error(c.post(GEN, json=body([POISON, 2, 3], [7])), 500)
        assert fired.wait(10)  # the process would now exit so the orchestrator restarts it
        assert_error(c.get("/health"), 503)
        assert_error(c.post(GEN, json=body([1, 2, 3], [7])), 503)


# --- SIGTERM drain ---------------------------------------------------------------------------

class ServeProcess:
    """`python -m teacher_server serve` on a free port, as the container runs it."""

    def __init__(self, tmp_path: Path, **settings: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, TEACHER_SERVER_DEMO_MODEL_DIR=str(tmp_path / "m"), TEACHER_SERVER_LOG_JSON="true",
                   **{"TEACHER_SERVER_" + k.upper(): v for k, v in settings.items()})
        self.proc = subprocess.Popen([sys.executable, "-m", "teacher_server", "serve", "--device", "cpu",
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 180) -> None:
        wait_healthy(self.url, self.proc, timeout)

    def in_flight(self, c: httpx.Client) -> float:
        m = c.get("/metrics").text
        return metric(m, "teacher_server_num_requests_running") + metric(m, "teacher_server_num_requests_waiting")

    def wait_in_flight(self, c: httpx.Client, n: int, timeout: float = 60) -> None:
        """Until ``n`` requests are queued or running."""
        wait_until(lambda: self.in_flight(c) >= n, timeout, f"{n} requests in flight")

    def wait_draining(self, c: httpx.Client, timeout: float = 10) -> None:
        """Until /health says 503 (the server took a signal and drains)."""
        wait_until(lambda: c.get("/health").status_code == 503, timeout, "draining after the signal")

    def log_lines(self) -> list[dict]:
        return [json.loads(x) for x in self.proc.stderr.read().splitlines() if x.startswith("{")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def post_in_threads(url: str, bodies: list[dict], paths: list[str] | None = None,
                    ) -> tuple[list[threading.Thread], dict[int, httpx.Response]]:
    out: dict[int, httpx.Response] = {}

    def post(i: int, b: dict) -> None:
        out[i] = httpx.post(url + (paths[i] if paths else GEN), json=b, timeout=300)

    threads = [threading.Thread(target=post, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    return threads, out


def test_sigterm_drains_in_flight_work(tmp_path) -> None:
    # 2000 tokens at 16 a step: 125 steps, so the request is still running when the drain starts
    s = ServeProcess(tmp_path, max_num_batched_tokens="16", shutdown_timeout_s="300")
    try:
        s.wait_ready()
        threads, out = post_in_threads(s.url, [long_body(2000)])
        with httpx.Client(base_url=s.url) as c:
            s.wait_in_flight(c, 1)
            s.proc.send_signal(signal.SIGTERM)
            s.wait_draining(c)
            assert_error(c.post(GEN, json=body([1, 2, 3], [4])), 503)  # draining: not admitted
            assert_error(c.get("/health"), 503)
        threads[0].join(300)
        assert out[0].status_code == 200, out[0].text  # in-flight work finished
        assert decode(out[0].json()["prompt_token_id_logprobs"]).shape == (1989, 3)
        assert s.proc.wait(60) == 0
        assert any("draining" in x["msg"] for x in s.log_lines())  # structured (JSON) logs
    finally:
        s.kill()


def test_the_drain_waits_for_an_answer_still_being_built(tmp_path, monkeypatch) -> None:
    """A request the engine has finished is not in flight for the engine, but its answer is
    still being written (classic prompt_logprobs: up to seconds of work): a drain that starts
    then lets it finish with 200, instead of cutting it off with a 503."""
    from teacher_server.server import generate, lifecycle

    monkeypatch.setattr(lifecycle, "_SERVER", None)
    building = threading.Event()
    real = generate.generate_body

    def slow_body(*a, **kw):
        building.set()
        time.sleep(1.5)
        return real(*a, **kw)

    monkeypatch.setattr(generate, "generate_body", slow_body)
    cfg = Config(demo_model_dir=str(tmp_path / "m"), device="cpu", shutdown_timeout_s=30)
    with LiveServer(cfg, drain_timeout=30) as s:
        threads, out = post_in_threads(s.url, [body(range(1, 40), [[5, 6]] * 30, start=8, prompt_logprobs=2)])
        assert building.wait(60)
        assert s.app.state.aengine.in_flight == 0 and s.app.state.handling == 1
        s.server.handle_exit(signal.SIGTERM, None)
        threads[0].join(60)
        assert out[0].status_code == 200, out[0].text[:300]
        assert decode(out[0].json()["prompt_token_id_logprobs"]).shape == (30, 2)
        wait_until(lambda: s.server.should_exit, 30, "the server to stop after the drain")
        assert s.app.state.handling == 0


def test_a_body_still_arriving_when_the_drain_ends_gets_the_json_503(tmp_path) -> None:
    """A request whose body is still on its way is not in flight: when the drain ends it is
    answered with the JSON 503 (not cancelled by uvicorn's shutdown, a plain-text 500), on every
    scoring endpoint."""
    s = ServeProcess(tmp_path, shutdown_timeout_s="5", body_timeout_s="60")
    socks = []
    try:
        s.wait_ready()
        for path, start in ((GEN, b'{"token_ids": [1, 2, 3'), ("/v1/completions", b'{"prompt": [1, 2, 3'),
                            ("/generate", b'{"input_ids": [1, 2, 3')):
            sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
            socks.append(sock)
            sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n" + start)  # and no more
        time.sleep(0.5)  # the server is reading the bodies
        s.proc.send_signal(signal.SIGTERM)
        for sock in socks:
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
            head, _, payload = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), got[:300]
            assert json.loads(payload)["error"]["code"] == 503
        assert s.proc.wait(60) == 0
    finally:
        for sock in socks:
            sock.close()
        s.kill()


def test_shutdown_takes_about_the_drain_timeout(tmp_path) -> None:
    """SIGTERM with long requests in flight: exit about T after the signal (not 3T + 5), and
    the requests cut off at T get a JSON 503 with Retry-After, on the trainers' endpoints too
    (theirs had been left to uvicorn's exit: a plain-text 500 at about 2T)."""
    drain_s = 5.0
    # a 16-token step budget: 4 x 8000 tokens take hundreds of steps, far longer than T
    s = ServeProcess(tmp_path, max_num_batched_tokens="16", shutdown_timeout_s=str(drain_s))
    ids = [np.random.default_rng(i).integers(0, 4096, 8000).tolist() for i in range(2)]
    bodies = [long_body(8000, seed=2), long_body(8000, seed=3),
              {"prompt": ids[0], "max_tokens": 0, "prompt_logprobs": 1},
              {"input_ids": ids[1], "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"max_new_tokens": 0}}]
    try:
        s.wait_ready()
        threads, out = post_in_threads(s.url, bodies, [GEN, GEN, "/v1/completions", "/generate"])
        with httpx.Client(base_url=s.url) as c:
            s.wait_in_flight(c, 4)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert code == 0
        assert drain_s - 0.5 <= elapsed <= drain_s + 10, elapsed  # was about 3T + 5 = 20 s
        for r in out.values():
            assert_error(r, 503, contains="shut down")
            assert int(r.headers["Retry-After"]) >= 1
        assert len(out) == 4
    finally:
        s.kill()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_exits_at_once(tmp_path, second) -> None:
    s = ServeProcess(tmp_path, max_num_batched_tokens="16", shutdown_timeout_s="120")
    try:
        s.wait_ready()
        threads, _ = post_in_threads(s.url, [long_body(8000)])
        with httpx.Client(base_url=s.url) as c:
            s.wait_in_flight(c, 1)
            s.proc.send_signal(signal.SIGTERM)
            s.wait_draining(c)  # the first signal has been handled: two pending ones would merge into one
        t0 = time.monotonic()
        s.proc.send_signal(second)
        s.proc.wait(60)
        assert time.monotonic() - t0 < 10  # not the 120 s drain
        threads[0].join(30)
    finally:
        s.kill()


def test_port_answers_while_the_engine_loads(tmp_path) -> None:
    """The port binds at once; /health is 503 {"status": "loading"} until the engine is ready."""
    loading = threading.Event()
    release = threading.Event()

    def slow_factory(cfg: Config) -> Engine:
        loading.set()
        assert release.wait(60)
        return Engine(cfg)

    from conftest import LiveServer as Live

    server = Live(Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_model_len=1024),
                  engine_factory=slow_factory)
    server.thread.start()
    try:
        assert loading.wait(60)
        deadline = time.time() + 60
        while not server.server.started:
            assert time.time() < deadline
            time.sleep(0.02)
        with server.client() as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            assert_error(r, 503)
            live = c.get("/livez")  # (the liveness probe's: the process answers)
            assert live.status_code == 200 and live.json() == {"status": "loading"}
            assert_error(c.post(GEN, json=body([1, 2, 3], [4])), 503)
            assert int(c.post(GEN, json=body([1, 2, 3], [4])).headers["Retry-After"]) >= 1
            assert c.get("/metrics").status_code == 200
            release.set()
            while c.get("/health").status_code != 200:
                assert time.time() < deadline
                time.sleep(0.05)
            assert c.get("/health").json() == {"status": "ready"}
            assert c.get("/livez").json() == {"status": "ready"} and c.head("/livez").status_code == 200
            assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200
    finally:
        release.set()
        server.__exit__()


def test_engine_that_fails_to_start_reports_failed(tmp_path) -> None:
    fired = threading.Event()

    def broken(cfg: Config) -> Engine:
        raise RuntimeError("no such checkpoint")

    from conftest import LiveServer as Live

    server = Live(Config(demo_model_dir=str(tmp_path / "m"), device="cpu"), engine_factory=broken, on_fatal=fired.set)
    with pytest.raises(RuntimeError, match="failed to start"):
        server.__enter__()
    assert fired.wait(10)  # the process would now exit so the orchestrator restarts it


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_engine_loads_exits_without_waiting_for_the_load(tmp_path, sig) -> None:
    port = free_port()
    script = tmp_path / "serve_slow.py"
    script.write_text(f"""
import time
from teacher_server.config import Config
from teacher_server.server.app import create_app
from teacher_server.server.http import uvicorn_config
from teacher_server.server.lifecycle import DrainingServer

def loads_for_minutes(cfg):
    time.sleep(600)

cfg = Config(device="cpu", host="127.0.0.1", port={port})
app = create_app(cfg, engine_factory=loads_for_minutes)
DrainingServer(uvicorn_config(app, cfg, timeout_graceful_shutdown=3), app, cfg.shutdown_timeout_s).run()
""")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"

        def loading() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).json().get("status") == "loading"
            except httpx.HTTPError:
                return False

        wait_until(loading, 60, "the server answering while its engine loads")
        proc.send_signal(sig)
        proc.wait(30)  # not the 600 s load
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_server_whose_engine_fails_to_start_exits_with_code_3(tmp_path) -> None:
    """The documented exit code, not 143: the fatal path's own SIGTERM is not re-raised at exit."""
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}')
    s = ServeProcess(tmp_path, model=str(empty))
    try:
        assert s.proc.wait(120) == 3
    finally:
        s.kill()


def test_json_log_carries_request_id() -> None:
    from teacher_server.logging_setup import JsonFormatter

    rec = logging.LogRecord("teacher_server.server", logging.WARNING, __file__, 1, "generate %s -> %d", ("r-1", 500),
                            None)
    rec.request_id, rec.status = "r-1", 500
    out = json.loads(JsonFormatter().format(rec))
    assert out["request_id"] == "r-1" and out["status"] == 500 and out["level"] == "warning"


@pytest.mark.parametrize(("kind", "status", "retry"), [("overloaded", 429, "1"), ("unavailable", 503, "5"),
                                                    ("internal", 500, None)])
def test_a_refusal_that_comes_back_as_a_result_carries_retry_after(demo_server, monkeypatch, kind, status,
                                                                  retry) -> None:
    """A replica's full queue or drain reaches the front as a failed result, not as the
    exceptions the front raises itself: the answer carries the same Retry-After."""
    from teacher_server.engine.request import ErrorKind, ScoreResult

    async def refuse(req):
        return ScoreResult.failed(req, ErrorKind(kind), f"refused: {kind}")

    monkeypatch.setattr(demo_server.app.state.aengine, "score", refuse)
    with demo_server.client() as c:
        r = c.post(GEN, json=body([1, 2, 3], [4]))
    assert_error(r, status, contains=f"refused: {kind}")
    assert r.headers.get("Retry-After") == retry


def test_the_deadline_holds_when_the_engine_does_not_answer(tmp_path_factory, monkeypatch) -> None:
    """request_timeout_s bounds a request's time even when its engine never answers (a step that
    does not end: a hung GPU or tensor-parallel worker): a 504 shortly after the deadline, its
    work cancelled."""
    cancelled = []

    async def never(req):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(req.request_id)
            raise

    with LiveServer(demo_cfg(tmp_path_factory, request_timeout_s=1.0)) as s, s.client() as c:
        monkeypatch.setattr(s.app.state.aengine, "score", never)
        t0 = time.monotonic()
        r = c.post(GEN, json={**body([1, 2, 3], [7]), "request_id": "stuck"})
        assert 1.0 <= time.monotonic() - t0 < 10
        assert_error(r, 504, contains="deadline")
        assert cancelled == ["stuck"]
        wait_until(lambda: s.app.state.handling == 0, 10, "the request counted out")


def test_request_larger_than_queue_is_400_not_429(tmp_path_factory) -> None:
    with LiveServer(demo_cfg(tmp_path_factory, max_queue_tokens=100)) as s, s.client() as c:
        assert_error(c.post(GEN, json=body(range(1, 200), [1])), 400, "token_ids", "max_queue_tokens")
        assert c.post(GEN, json=body(range(1, 50), [1])).status_code == 200


# --- hostile clients ---------------------------------------------------------------------------

def raw_request(port: int, head: bytes, timeout: float = 30) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head)
    return sock


def test_mid_body_disconnect_is_counted_not_a_500(demo_server, caplog) -> None:
    with demo_server.client() as c:
        before = c.get("/metrics").text
        for _ in range(3):
            sock = raw_request(demo_server.port, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b"[1," * 300)
            sock.close()  # gone with most of the body unsent
        deadline = time.time() + 30
        while True:
            m = c.get("/metrics").text
            if metric(m, "teacher_server_request_failures_total", reason="disconnected") - \
                    metric(before, "teacher_server_request_failures_total", reason="disconnected") >= 3:
                break
            assert time.time() < deadline, "disconnects not counted"
            time.sleep(0.05)
        assert metric(m, "teacher_server_requests_total", status="500") == \
            metric(before, "teacher_server_requests_total", status="500")
        assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_slow_headers_and_slow_bodies_are_cut_off(tmp_path_factory) -> None:
    """A byte every 0.2 s: the headers must be complete within header_timeout_s (then the
    connection is closed) and the body within body_timeout_s (then 408)."""
    cfg = demo_cfg(tmp_path_factory, header_timeout_s=1.0, body_timeout_s=1.5)
    with LiveServer(cfg) as s:
        def trickle(sock: socket.socket, data: bytes, limit_s: float) -> tuple[bytes, float]:
            t0 = time.monotonic()
            sock.settimeout(0.2)
            for i in range(len(data)):
                try:
                    sock.sendall(data[i:i + 1])
                    got = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:  # reset: closed by the server
                    return b"", time.monotonic() - t0
                dt = time.monotonic() - t0
                sock.settimeout(2.0)  # the response may arrive in several segments: read it all
                try:
                    while more := sock.recv(65536):
                        got += more
                except OSError:
                    pass
                return got, dt
            raise AssertionError(f"still open after {time.monotonic() - t0:.1f}s (limit {limit_s}s)")

        sock = raw_request(s.port, b"")
        got, dt = trickle(sock, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200, 1.0)
        assert got == b"" and dt < 6, (got, dt)  # closed, no response
        sock.close()

        payload = json.dumps(body([1, 2, 3], [4])).encode() + b" " * 100
        sock = raw_request(s.port, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                           b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n")
        got, dt = trickle(sock, payload, 1.5)
        sock.close()
        assert got.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in got and dt < 8, (got[:200], dt)
        with s.client() as c:  # the server is fine, and says why it cut those off
            assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200
            assert metric(c.get("/metrics").text, "teacher_server_request_failures_total", reason="body_timeout") == 1


def test_oversized_token_ids_are_refused_before_the_rest_is_parsed(demo_server) -> None:
    """The length of token_ids is read off the raw body first: with an invalid field as well,
    the error is about the length (a full parse would have reported the other field)."""
    ids = b"1234," * 20_000 + b"1"  # 20001 ids > max_model_len 8192, a 100 kB body
    with demo_server.client() as c:
        for extra in (b',"sampling_params":{"bogus":1}', b',"stream":"yes"', b',"nope":1'):
            r = c.post(GEN, content=b'{"request_id":"big-1","token_ids":[' + ids + b"]" + extra + b"}",
                       headers={"content-type": "application/json"})
            assert_error(r, 400, "token_ids", "max_model_len")
        # a nested key of that name (met first) is not the request's token_ids: parsed as usual
        nested = b'{"sampling_params":{"extra_args":{"token_ids":[' + ids + b']}},"token_ids":[1,2,3]}'
        assert c.post(GEN, content=nested, headers={"content-type": "application/json"}).status_code == 200


def test_request_ids_cannot_forge_log_lines(demo_server, caplog) -> None:
    from teacher_server.logging_setup import JsonFormatter, TextFormatter

    forged = "r-1\n2026-01-01 00:00:00,000 INFO teacher_server.server: forged\r\x1b[2J\u2028\x9b31m\x85"
    caplog.set_level(logging.INFO, logger="teacher_server")
    with demo_server.client() as c:
        assert c.post(GEN, json={**body([1, 2, 3], [4]), "request_id": forged}).status_code == 200
        assert_error(c.post(GEN, json={"token_ids": [], "request_id": forged}), 400)
    lines = [r for r in caplog.records if r.name == "teacher_server.access" and r.request_id == forged[:128]]
    assert len(lines) == 2
    fmt = TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for rec in lines:
        for text in (fmt.format(rec), JsonFormatter().format(rec)):  # C1's 0x9b: a terminal's CSI
            assert not any(ch in text for ch in "\n\r\x1b\u2028\x9b\x85"), text
            assert "\\n2026-01-01" in text  # written as an escape, still readable
        assert json.loads(JsonFormatter().format(rec))["request_id"] == forged[:128]


def test_access_line_and_vllm_metric_names(demo_server, caplog) -> None:
    caplog.set_level(logging.INFO, logger="teacher_server")
    with demo_server.client() as c:
        assert c.post(GEN, json={**body(range(1, 41), [1, 2], start=30), "request_id": "acc-1"}).status_code == 200
        assert_error(c.post(GEN, json={**body([1, 2], [9999]), "request_id": "acc-bad"}), 400)
        m = c.get("/metrics").text
    access = {r.request_id: r for r in caplog.records if r.name == "teacher_server.access"}
    ok, bad = access["acc-1"], access["acc-bad"]  # a 400 is logged under the body's id
    assert (ok.levelno, ok.status, ok.tokens, ok.rows) == (logging.INFO, 200, 40, 9) and ok.latency_s > 0
    assert "acc-1" in ok.getMessage() and "200" in ok.getMessage()
    assert (bad.levelno, bad.status) == (logging.INFO, 400)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:prefix_cache_queries_total"):
        assert name + "{" in m, name
    assert metric(m, "vllm:prompt_tokens_total") == metric(m, "teacher_server_prompt_tokens_total") > 0
    assert "_created" not in m


def test_body_gate_reads_large_bodies_in_turn() -> None:
    """BodyGate: at most ``slots`` large bodies read at once, in arrival order; small ones do
    not queue; a waiter gives up after max_wait_s and reads anyway; a cancelled waiter leaves
    no slot behind."""
    from teacher_server.server.http import BodyGate

    async def main() -> None:
        gate = BodyGate(2, max_wait_s=5.0)
        inside, most, order = 0, 0, []

        async def reader(i: int, hold: float) -> None:
            nonlocal inside, most
            async with gate.turn(BodyGate.LARGE):
                inside += 1
                most = max(most, inside)
                order.append(i)
                await asyncio.sleep(hold)
                inside -= 1

        tasks = []
        for i in range(6):
            tasks.append(asyncio.ensure_future(reader(i, 0.05)))
            await asyncio.sleep(0)  # arrive in this order
        await asyncio.gather(*tasks)
        assert most == 2 and order == list(range(6)), (most, order)

        async with gate.turn(None), gate.turn(None):  # both slots held (None: chunked, size unknown)
            t0 = time.monotonic()
            async with gate.turn(BodyGate.LARGE - 1), gate.turn(100), gate.turn(0):  # small bodies: no queue
                assert gate._free == 0 and not gate._waiting
            assert time.monotonic() - t0 < 1.0  # (a queued one would wait max_wait_s, 5 s)
        assert gate._free == 2

        # a waiter cancelled (its client went away) leaves the free count as it was
        held = asyncio.Event()
        release = asyncio.Event()

        async def hold_both() -> None:
            async with gate.turn(None), gate.turn(None):
                held.set()
                await release.wait()

        holder = asyncio.ensure_future(hold_both())
        await held.wait()
        waiter = asyncio.ensure_future(reader(99, 0))
        await asyncio.sleep(0.05)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        release.set()
        await holder
        assert gate._free == 2 and not [f for f in gate._waiting if not f.done()]

        # slots held by slow senders hold the others back for max_wait_s at most
        slow = BodyGate(1, max_wait_s=0.2)
        stuck = asyncio.Event()

        async def stall() -> None:
            async with slow.turn(None):
                await stuck.wait()

        staller = asyncio.ensure_future(stall())
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        async with slow.turn(None):
            waited = time.monotonic() - t0
        assert 0.15 < waited < 2.0, waited
        stuck.set()
        await staller
        assert slow._free == 1

    asyncio.run(main())


def test_a_slow_sender_does_not_hold_up_large_bodies(tmp_path_factory) -> None:
    """With one body slot, a client trickling a large body holds the slot; a fast large
    request behind it waits at most the gate's 0.25 s, then reads and is answered, long before
    the slow one's body_timeout_s."""
    cfg = demo_cfg(tmp_path_factory, body_read_slots=1, body_timeout_s=20)
    with LiveServer(cfg) as s:
        slow = raw_request(s.port, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 400000\r\n\r\n" + b"{" + b" " * 1000)
        try:
            gate = s.app.state.body_gate
            wait_until(lambda: gate._free == 0)  # its body is being read: it holds the slot
            payload = json.dumps(body([1, 2, 3], [4])).encode() + b" " * 300_000  # a large body
            with s.client() as c:
                t0 = time.monotonic()
                r = c.post(GEN, content=payload, headers={"content-type": "application/json"})
                dt = time.monotonic() - t0
            assert r.status_code == 200, r.text[:300]
            assert gate.max_wait_s * 0.8 <= dt < 10, dt  # it waited for the slot, then read anyway
        finally:
            slow.close()


def test_missing_simd_base64_is_logged(monkeypatch, caplog) -> None:
    """Without pybase64 (a server requirement) the server still serves, with the standard
    library's codec, and says so once at start-up."""
    from teacher_server import b64
    from teacher_server.server.app import create_app

    def never(cfg: Config) -> Engine:
        raise AssertionError("the engine is not built before the app starts")

    pytest.importorskip("pybase64")  # installed with the server
    with caplog.at_level(logging.WARNING, logger="teacher_server.server"):
        create_app(Config(device="cpu"), engine_factory=never)
        assert not any("pybase64" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(b64, "_fast", None)
        create_app(Config(device="cpu"), engine_factory=never)
    assert sum("pybase64" in r.getMessage() for r in caplog.records) == 1


def test_a_fatal_error_drains_without_a_signal(tmp_path, monkeypatch) -> None:
    """``terminate_self`` asks the server to drain without sending a signal: during a drain it
    leaves the drain going (an operator's second signal would cut everything off, and still
    does); while nothing is being served it stops the server with no signal recorded, so
    uvicorn re-raises none at exit (the exit code stays 3)."""
    from teacher_server.server import lifecycle
    from teacher_server.server.app import create_app
    from teacher_server.server.http import uvicorn_config

    class FakeEngine:
        in_flight = 1

        def stop_accepting(self) -> None:
            pass

    monkeypatch.setattr(lifecycle, "_SERVER", None)
    monkeypatch.setattr(lifecycle.os, "kill", lambda *a: pytest.fail("terminate_self sent a signal"))
    monkeypatch.setattr(lifecycle, "FATAL_EXIT_S", 3600.0)  # (its hard-exit thread must not fire in the test)
    app = create_app(Config(demo_model_dir=str(tmp_path / "m"), device="cpu"))
    server = lifecycle.DrainingServer(uvicorn_config(app, Config(device="cpu")), app, drain_timeout=60)
    app.state.aengine = FakeEngine()
    server.handle_exit(signal.SIGTERM, None)  # the operator's: the drain starts
    assert server._draining and not server.should_exit
    lifecycle.terminate_self()  # a replica died meanwhile
    assert not server.force_exit and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)  # the operator's second signal still cuts off
    assert server.force_exit
    idle = lifecycle.DrainingServer(uvicorn_config(app, Config(device="cpu")), app, drain_timeout=60)
    app.state.aengine = None  # failed to start
    lifecycle.terminate_self()
    assert idle.should_exit and not idle._captured_signals


def test_a_handler_cancelled_while_its_body_arrives_leaves_nothing_counted(tmp_path) -> None:
    """The server's own shutdown may cancel a handler whose body is still on its way: its work is
    cancelled with it, so it is never admitted later and counted in flight for good (a drain
    would then wait its whole timeout for nothing)."""
    from teacher_server.server.app import create_app

    app = create_app(Config(demo_model_dir=str(tmp_path / "m"), device="cpu"))
    payload = json.dumps(body(range(1, 40), [1, 2])).encode()

    async def main() -> None:
        async with app.router.lifespan_context(app):
            st = app.state
            while st.aengine is None:
                await asyncio.sleep(0.05)
            arrived = asyncio.Event()

            async def receive() -> dict:
                await arrived.wait()
                return {"type": "http.request", "body": payload, "more_body": False}

            async def send(message: dict) -> None:
                pass

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": GEN, "raw_path": GEN.encode(), "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(payload)).encode())],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}, "app": app}
            handler = asyncio.create_task(app(scope, receive, send))
            await asyncio.sleep(0.3)
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handler
            arrived.set()  # the body arrives after all
            await asyncio.sleep(1.0)
            assert st.handling == 0 and st.aengine.in_flight == 0

    asyncio.run(main())


def test_a_replicas_kernel_switches_are_gauges() -> None:
    """Each replica's snapshot sets its kernels' gauges: 1 on, 0 off, per replica."""
    from prometheus_client import generate_latest

    from teacher_server.engine.stats import EngineStats, StepTiming
    from teacher_server.server.metrics import Metrics

    m = Metrics("t", replicas=2)
    base = dict(timing=StepTiming(), steps=0, computed_tokens=0, waiting=0, running=0, active_requests=0,
                kv_blocks_used=0, kv_blocks_total=1, prefix_query_tokens=0, prefix_hit_tokens=0)
    m.observe_gauges(EngineStats(**base, kernels=(("router_kernel", True), ("group_kernel", False))), 0)
    m.observe_gauges(EngineStats(**base, kernels=(("router_kernel", False), ("group_kernel", True))), 1)
    text = generate_latest(m.registry).decode()
    assert metric(text, "teacher_server_kernel_enabled", kernel="router_kernel", replica="0") == 1
    assert metric(text, "teacher_server_kernel_enabled", kernel="router_kernel", replica="1") == 0
    assert metric(text, "teacher_server_kernel_enabled", kernel="group_kernel", replica="1") == 1


def test_a_dead_replica_holds_nothing_and_its_successor_is_counted_whole() -> None:
    """A replica that goes down had its last snapshot's running request and KV blocks on the
    gauges until its successor reported (the request had gone to the other replica: two running
    for one); the successor's totals, from 0 again, are counted whole."""
    from prometheus_client import generate_latest

    from teacher_server.engine.stats import EngineStats, StepTiming
    from teacher_server.server.metrics import Metrics

    m = Metrics("t", replicas=2)
    base = dict(timing=StepTiming(), computed_tokens=0, waiting=2, running=1, active_requests=3,
                kv_blocks_used=5, kv_blocks_total=10, prefix_query_tokens=0, prefix_hit_tokens=0)
    m.observe_engine(EngineStats(**base, steps=7), 0)
    m.observe_engine(EngineStats(**base, steps=4), 1)
    m.set_healthy(False, 0)
    text = generate_latest(m.registry).decode()
    for name in ("teacher_server_num_requests_running", "teacher_server_num_requests_waiting",
                 "teacher_server_kv_cache_usage_perc"):
        assert metric(text, name, replica="0") == 0 and metric(text, name, replica="1") > 0, name
    m.set_healthy(True, 0)
    m.observe_engine(EngineStats(**{**base, "running": 0, "waiting": 0}, steps=3), 0)  # the successor's first
    text = generate_latest(m.registry).decode()
    assert metric(text, "teacher_server_engine_steps_total", replica="0") == 10


def test_a_teachers_fatal_error_marks_that_teacher_unhealthy() -> None:
    """The fatal hook of a teacher's engine marks its own series (it had marked the first
    teacher's, whatever teacher failed)."""
    from prometheus_client import generate_latest
    from starlette.datastructures import State

    from teacher_server.server.lifecycle import on_engine_fatal
    from teacher_server.server.metrics import Metrics

    first = Metrics("a")
    second = first.for_model("b", 1)
    for m in (first, second):
        m.set_healthy(True)
    app = State()
    app.state = State()
    app.state.metrics = first
    on_engine_fatal(app, RuntimeError("teacher b: gone"), lambda: None, second)
    text = generate_latest(first.registry).decode()
    assert metric(text, "teacher_server_healthy", model_name="a") == 1
    assert metric(text, "teacher_server_healthy", model_name="b") == 0


def test_the_trainers_endpoints_are_counted_and_logged_as_the_native_one(tmp_path_factory, caplog) -> None:
    """/v1/completions and SGLang's /generate count their scored rows and time their requests'
    queue and inference as the native endpoint does (they counted neither), their access lines
    give the rows and, on a refusal after the body was read, its tokens (0 had been logged); a
    refused SGLang call without ``rid`` is logged by the X-Request-Id its answer carries (an id
    of ours, in no answer, had been); a 401 is timed as it is counted."""
    caplog.set_level(logging.INFO, logger="teacher_server.access")
    cfg = demo_cfg(tmp_path_factory, max_queue_tokens=15, api_key="k")
    auth = {"Authorization": "Bearer k"}
    # (path, body, the result-matrix rows it scores: the completion's are classic logprobs, no matrix)
    calls = [(GEN, body(range(1, 11), [[5, 6]] * 9, start=0), 9),
             ("/v1/completions", {"prompt": list(range(1, 11)), "max_tokens": 1, "echo": True, "logprobs": 1,
                                  "logprob_token_ids": [5, 6], "return_tokens_as_token_ids": True}, 0),
             ("/generate", {"input_ids": list(range(1, 11)), "return_logprob": True, "max_new_tokens": 0,
                            "logprob_start_len": 0, "token_ids_logprob": [5, 6]}, 9)]
    with LiveServer(cfg) as s, s.client() as c:
        for path, b, want in calls:
            before = c.get("/metrics").text
            assert c.post(path, json=b, headers=auth).status_code == 200, path
            after = c.get("/metrics").text
            for name in ("teacher_server_request_queue_time_seconds_count",
                         "teacher_server_request_inference_time_seconds_count"):
                assert metric(after, name) - metric(before, name) == 1, (path, name)
            rows = metric(after, "teacher_server_scored_rows_total") - metric(before, "teacher_server_scored_rows_total")
            assert rows == want, (path, rows)
        long = {"input_ids": list(range(1, 21)), "return_logprob": True, "max_new_tokens": 0}
        for rid, named in (({}, "mine-1"), ({"rid": ""}, "mine-2")):  # (rid "" names nothing: SGLang's uuid)
            refused = c.post("/generate", json={**long, **rid}, headers={**auth, "X-Request-Id": named})
            assert_error(refused, 400, contains="more than the queue holds")
            assert refused.headers["x-request-id"] == named
        assert c.post(GEN, json=body([1, 2, 3], [5]), headers={"X-Request-Id": "no-key"}).status_code == 401
        text = c.get("/metrics").text
        assert metric(text, "teacher_server_e2e_request_latency_seconds_count") == \
            metric(text, "teacher_server_requests_total")
    lines = {r.request_id: r for r in caplog.records if r.name == "teacher_server.access" and hasattr(r, "request_id")}
    for named in ("mine-1", "mine-2"):
        assert lines[named].status == 400 and lines[named].tokens == 20 and lines[named].rows == 19
    ok = [r for r in caplog.records if r.name == "teacher_server.access" and getattr(r, "status", 0) == 200]
    assert [r.rows for r in ok] == [9, 0, 9], [r.getMessage() for r in ok]
