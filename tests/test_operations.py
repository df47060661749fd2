"""Operations: limits, backpressure, cancellation, deadlines, auth, metrics, SIGTERM drain,
fault isolation, structured logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
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
from conftest import LiveServer, free_port
from engine_util import fail_on_token

from teacher_server.config import Config
from teacher_server.engine.engine import Engine

GEN = "/inference/v1/generate"
ROOT = Path(__file__).resolve().parents[1]


def demo_cfg(tmp_path_factory, **kw) -> Config:  # noqa: ANN001, ANN003
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

def test_api_key(tmp_path_factory) -> None:  # noqa: ANN001
    with LiveServer(demo_cfg(tmp_path_factory, api_key="s3cret")) as s, s.client() as c:
        good = body([1, 2, 3, 4], [5, 6])
        assert_error(c.post(GEN, json=good), 401)
        assert_error(c.post(GEN, json=good, headers={"Authorization": "Bearer EMPTY"}), 401)
        assert_error(c.post(GEN, json=good, headers={"Authorization": "s3cret"}), 401)
        assert_error(c.get("/v1/models"), 401)
        assert c.post(GEN, json=good, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # open by default
        assert c.get("/metrics").status_code == 200
    with LiveServer(demo_cfg(tmp_path_factory, api_key="k", auth_exempt_health=False,
                             auth_exempt_metrics=False)) as s, s.client() as c:
        assert_error(c.get("/health"), 401)
        assert_error(c.get("/metrics"), 401)
        assert c.get("/health", headers={"Authorization": "Bearer k"}).status_code == 200


# --- limits --------------------------------------------------------------------------------

def test_body_limit_and_rows_x_k(tmp_path_factory) -> None:  # noqa: ANN001
    with LiveServer(demo_cfg(tmp_path_factory, max_body_bytes=1 << 20, max_rows_x_k=1000)) as s, s.client() as c:
        big = body(list(range(1, 4000)) * 60)  # ~ 1.3 MB
        assert_error(c.post(GEN, json=big), 413, contains="exceeds")

        def chunks():  # no Content-Length: the limit holds while streaming
            for _ in range(300):
                yield b" " * 8192
        assert_error(c.post(GEN, content=chunks(), headers={"content-type": "application/json"}), 413)
        assert_error(c.post(GEN, json=body(range(500), [1, 2, 3])), 400, contains="rows*K")
        assert c.post(GEN, json=body(range(100), [1, 2, 3])).status_code == 200


def test_hundred_megabyte_body(demo_server) -> None:  # noqa: ANN001
    payload = b'{"token_ids": [' + b"1234," * (20 * 1024 * 1024) + b"1]}"  # 100 MB
    with demo_server.client() as c:
        r = c.post(GEN, content=payload, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500
        assert_error(r, r.status_code)
        assert c.get("/health").status_code == 200


# --- backpressure ---------------------------------------------------------------------------

def test_overload_gets_429_and_accepted_requests_complete(tmp_path_factory) -> None:  # noqa: ANN001
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

def test_disconnect_frees_the_request(tmp_path_factory) -> None:  # noqa: ANN001
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


def test_deadline(tmp_path_factory) -> None:  # noqa: ANN001
    cfg = demo_cfg(tmp_path_factory, request_timeout_s=0.3, max_num_batched_tokens=64)
    with LiveServer(cfg) as s, s.client() as c:
        assert_error(c.post(GEN, json=long_body(8000)), 504, contains="deadline")
        assert c.post(GEN, json=body([1, 2, 3], [4])).status_code == 200
        assert s.app.state.engine.stats().kv_blocks_used == 0


# --- metrics ----------------------------------------------------------------------------------

def test_metrics_names(demo_server) -> None:  # noqa: ANN001
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


# --- fault isolation ---------------------------------------------------------------------------

POISON = 4095


def faulty_engine(exc_factory):  # noqa: ANN001, ANN201
    def factory(cfg: Config) -> Engine:
        eng = Engine(cfg)
        fail_on_token(eng, POISON, exc_factory)
        return eng
    return factory


@pytest.mark.parametrize("exc", [lambda: RuntimeError("injected step failure"),
                                 lambda: torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")])
def test_step_failure_fails_only_that_step(tmp_path_factory, exc) -> None:  # noqa: ANN001
    cfg = demo_cfg(tmp_path_factory)
    with LiveServer(cfg, engine_factory=faulty_engine(exc)) as s, s.client() as c:
        good = body([1, 2, 3, 4, 5], [7, 8], start=1)
        before = c.post(GEN, json=good).json()["prompt_token_id_logprobs"]
        r = c.post(GEN, json=body([POISON, 2, 3], [7]))
        assert_error(r, 500, contains="inference failed")
        assert c.get("/health").status_code == 200
        assert c.post(GEN, json=good).json()["prompt_token_id_logprobs"] == before
        assert s.app.state.engine.stats().kv_blocks_used == 0


def test_unrecoverable_failure_turns_unhealthy(tmp_path_factory) -> None:  # noqa: ANN001
    fired = threading.Event()
    cfg = demo_cfg(tmp_path_factory)
    factory = faulty_engine(lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with LiveServer(cfg, engine_factory=factory, on_fatal=fired.set) as s, s.client() as c:
        assert_error(c.post(GEN, json=body([POISON, 2, 3], [7])), 500)
        assert fired.wait(10)  # the process would now exit so the orchestrator restarts it
        assert_error(c.get("/health"), 503)
        assert_error(c.post(GEN, json=body([1, 2, 3], [7])), 503)


# --- SIGTERM drain ---------------------------------------------------------------------------

def test_sigterm_drains_in_flight_work(tmp_path) -> None:  # noqa: ANN001
    port = free_port()
    env = dict(os.environ, TEACHER_SERVER_DEMO_MODEL_DIR=str(tmp_path / "m"), TEACHER_SERVER_DEVICE="cpu",
               TEACHER_SERVER_MAX_NUM_BATCHED_TOKENS="64", TEACHER_SERVER_SHUTDOWN_TIMEOUT_S="60",
               TEACHER_SERVER_LOG_JSON="true")
    proc = subprocess.Popen([sys.executable, "-m", "teacher_server", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.2)
        result: dict = {}

        def slow() -> None:
            result["r"] = httpx.post(url + GEN, json=long_body(6000), timeout=120)

        t = threading.Thread(target=slow)
        t.start()
        with httpx.Client(base_url=url) as c:
            while metric(c.get("/metrics").text, "teacher_server_num_requests_running") + \
                    metric(c.get("/metrics").text, "teacher_server_num_requests_waiting") < 1:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert_error(c.post(GEN, json=body([1, 2, 3], [4])), 503)  # draining: not admitted
            assert_error(c.get("/health"), 503)
        t.join(120)
        assert result["r"].status_code == 200  # in-flight work finished
        assert decode(result["r"].json()["prompt_token_id_logprobs"]).shape == (5989, 3)
        assert proc.wait(60) == 0
        lines = [json.loads(x) for x in proc.stderr.read().splitlines() if x.startswith("{")]
        assert any("draining" in x["msg"] for x in lines)  # structured (JSON) logs
    finally:
        if proc.poll() is None:
            proc.kill()


def test_json_log_carries_request_id() -> None:
    from teacher_server.logging_setup import JsonFormatter

    rec = logging.LogRecord("teacher_server.server", logging.WARNING, __file__, 1, "generate %s -> %d", ("r-1", 500),
                            None)
    rec.request_id, rec.status = "r-1", 500
    out = json.loads(JsonFormatter().format(rec))
    assert out["request_id"] == "r-1" and out["status"] == 500 and out["level"] == "warning"


def test_request_larger_than_queue_is_400_not_429(tmp_path_factory) -> None:  # noqa: ANN001
    with LiveServer(demo_cfg(tmp_path_factory, max_queue_tokens=100)) as s, s.client() as c:
        assert_error(c.post(GEN, json=body(range(1, 200), [1])), 400, "token_ids", "max_queue_tokens")
        assert c.post(GEN, json=body(range(1, 50), [1])).status_code == 200
