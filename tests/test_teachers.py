"""Several teachers behind one service (``teachers``): two tiny teachers of different vocabularies
(the demo model, 4096 ids; a tiny Qwen3, 512 ids, two replicas) on the CPU. Each answer must
equal the single-teacher server's for that model on every endpoint, requests go by their
`model`, and a teacher that goes down leaves the other serving."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import numpy as np
import pytest
from conftest import LiveServer, wait_until

from teacher_server.client import TeacherClient, TeacherRequest, TeacherServerError
from teacher_server.config import Config

TOL = 2e-5
VOCAB = {"demo": 4096, "qwen": 512}


@pytest.fixture(scope="module")
def multi(demo_server, qwen3_server):
    cfg = Config(device="cpu", max_num_batched_tokens=512, block_size=8, num_kv_blocks=512, max_model_len=1024,
                 max_logprobs=16, replica_restart_backoff_s=120,
                 teachers=[{"name": "demo", "demo_model_dir": demo_server.cfg.demo_model_dir},
                           {"name": "qwen", "model": qwen3_server.cfg.model, "data_parallel_size": 2,
                            "served_model_aliases": ["qwen-alias"]}])
    with LiveServer(cfg) as s:
        yield s


def _requests(name: str, seed: int, n: int) -> list[TeacherRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB[name], int(rng.integers(8, 60)))
        start = int(rng.integers(0, len(toks) - 2))
        out.append(TeacherRequest(toks, rng.integers(0, VOCAB[name], (len(toks) - 1 - start, 4)), start, model=name))
    return out


def _singles(demo_server, qwen3_server) -> dict[str, LiveServer]:
    return {"demo": demo_server, "qwen": qwen3_server}


def test_answers_equal_single_teacher_servers_under_interleaved_load(multi, demo_server, qwen3_server):
    reqs = {name: _requests(name, i, 12) for i, name in enumerate(VOCAB)}
    want = {}
    for name, single in _singles(demo_server, qwen3_server).items():
        with TeacherClient(single.url) as c:  # (no model: the one it serves)
            want[name] = [c.score(r.token_ids, r.candidates, r.start) for r in reqs[name]]
    mixed = [r for pair in zip(reqs["demo"], reqs["qwen"]) for r in pair]  # demo, qwen, demo, ...
    with TeacherClient(multi.url, max_concurrency=8) as c:
        got = c.score_batch(mixed)
        # the client's own model, overridden per call
        one = c.score(reqs["qwen"][0].token_ids, reqs["qwen"][0].candidates, reqs["qwen"][0].start, model="qwen-alias")
    for i, r in enumerate(mixed):
        np.testing.assert_allclose(got[i], want[r.model][i // 2], atol=TOL, rtol=0)
    np.testing.assert_allclose(one, want["qwen"][0], atol=TOL, rtol=0)
    assert got[0].shape[1] == 4


def _numbers(x: object) -> list[float]:
    """Every float of a JSON answer, in order (ids and names aside)."""
    if isinstance(x, dict):
        return [v for k in sorted(x) if k not in ("id", "model", "created", "request_id", "e2e_latency")
                for v in _numbers(x[k])]
    if isinstance(x, list):
        return [v for item in x for v in _numbers(item)]
    return [x] if isinstance(x, float) else []


@pytest.mark.parametrize("name", list(VOCAB))
def test_trainer_endpoints_route_by_model(multi, demo_server, qwen3_server, name):
    single = _singles(demo_server, qwen3_server)[name]
    ids = np.random.default_rng(7).integers(0, VOCAB[name], 24).tolist()
    comp = {"prompt": ids, "max_tokens": 0, "echo": True, "prompt_logprobs": 3}
    sgl = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
           "max_new_tokens": 0}
    for path, body in (("/v1/completions", comp), ("/generate", sgl)):
        want = httpx.post(single.url + path, json=body, timeout=60)
        got = httpx.post(multi.url + path, json={**body, "model": name}, timeout=60)
        assert want.status_code == got.status_code == 200, (path, got.text[:300])
        a, b = _numbers(want.json()), _numbers(got.json())
        assert len(a) == len(b) > 20, (path, len(a), len(b))
        np.testing.assert_allclose(b, a, atol=TOL, rtol=0)
    assert httpx.post(multi.url + "/v1/completions", json={**comp, "model": name}).json()["model"] == name


def test_unknown_or_missing_model_on_every_endpoint(multi):
    gen = {"token_ids": [1, 2, 3, 4], "sampling_params": {"prompt_logprob_token_ids": [[1], [2], [3]]}}
    bodies = {"/inference/v1/generate": gen, "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True,
                                                                 "prompt_logprobs": 1},
              "/generate": {"input_ids": [1, 2, 3], "return_logprob": True, "max_new_tokens": 0}}
    for path, body in bodies.items():
        r = httpx.post(multi.url + path, json={**body, "model": "nope"}, timeout=30)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == 404 and "demo, qwen" in err["message"], (path, err)
        r = httpx.post(multi.url + path, json=body, timeout=30)  # no model: which teacher is not guessed
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", (path, r.text)
        assert httpx.post(multi.url + path, content=b"{not json", timeout=30).status_code == 400
    # a refusal of the `model` is named by the body's id, as with one teacher (it had become one of ours)
    for path, body, said in (("/inference/v1/generate", {**gen, "request_id": "rid-1"}, "rid-1"),
                             ("/v1/completions", {**bodies["/v1/completions"], "request_id": "rid-2"}, "cmpl-rid-2"),
                             ("/generate", {**bodies["/generate"], "rid": "rid-3"}, "rid-3"),
                             # (SGLang's one rid over a batch: the first prompt's, as with one teacher)
                             ("/generate", {**bodies["/generate"], "input_ids": [[1, 2], [3, 4]], "rid": "r"}, "r_0")):
        r = httpx.post(multi.url + path, json={**body, "model": "nope"}, timeout=30)
        assert r.status_code == 404 and r.headers["x-request-id"] == said, (path, r.headers)
    # a token id of the larger vocabulary is out of range for the smaller one (each teacher's own limits)
    big = {**gen, "token_ids": [1, 2, 3, 4000]}
    assert httpx.post(multi.url + "/inference/v1/generate", json={**big, "model": "demo"}).status_code == 200
    r = httpx.post(multi.url + "/inference/v1/generate", json={**big, "model": "qwen"})
    assert r.status_code == 400 and "512" in r.text, r.text


def test_a_request_body_is_parsed_once(multi, monkeypatch):
    """With several teachers the body's JSON object, parsed to read its `model`, is what the
    teacher's endpoint validates: the bytes are parsed once on every endpoint (twice before)."""
    import orjson

    bodies = {"/inference/v1/generate": {"token_ids": [1, 2, 3, 4], "sampling_params": {
                  "prompt_logprob_token_ids": [[1], [2], [3]]}},
              "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "prompt_logprobs": 1},
              "/generate": {"input_ids": [1, 2, 3], "return_logprob": True, "max_new_tokens": 0}}
    parsed: list[object] = []
    real = orjson.loads
    monkeypatch.setattr(orjson, "loads", lambda raw: parsed.append(raw) or real(raw))
    for path, body in bodies.items():
        for model in VOCAB:
            raw = orjson.dumps({**body, "model": model})
            parsed.clear()
            r = httpx.post(multi.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 200, (path, r.text)
            assert parsed.count(raw) == 1, (path, model, len(parsed))


def test_models_lists_every_teacher(multi, demo_server, qwen3_server):
    data = httpx.get(multi.url + "/v1/models").json()["data"]
    assert [d["id"] for d in data] == ["demo", "qwen"]
    assert [d["vocab_size"] for d in data] == [VOCAB["demo"], VOCAB["qwen"]]
    for d, single in zip(data, (demo_server, qwen3_server)):
        (one,) = httpx.get(single.url + "/v1/models").json()["data"]
        assert d["tokenizer"] == one["tokenizer"] and d["root"] == one["root"]
        assert d["max_model_len"] == 1024


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_metrics_carry_the_model(multi):
    for name in VOCAB:
        r = _requests(name, 3, 1)[0]
        with TeacherClient(multi.url, model=name) as c:
            c.score(r.token_ids, r.candidates, r.start)
    text = httpx.get(multi.url + "/metrics").text
    reqs = _series(text, "teacher_server_requests_total")
    for name in VOCAB:
        assert reqs[f'model_name="{name}",status="200"'] >= 1, reqs
    healthy = _series(text, "teacher_server_healthy")
    assert healthy == {'model_name="demo",replica="0"': 1.0, 'model_name="qwen",replica="0"': 1.0,
                       'model_name="qwen",replica="1"': 1.0}, healthy
    tokens = _series(text, "teacher_server_prompt_tokens_total")
    assert tokens['model_name="demo"'] > 0 and tokens['model_name="qwen"'] > 0, tokens
    waits = _series(text, "teacher_server_estimated_queue_wait_seconds")  # each teacher's own queue
    assert set(waits) == {'model_name="demo"', 'model_name="qwen"'}, waits
    # the bytes in flight are the service's, under the first teacher only (the second's read 0 for ever)
    assert set(_series(text, "teacher_server_inflight_bytes")) == {'model_name="demo"'}, text
    teachers = multi.app.state.teachers.all
    assert teachers[0].queue_wait is not teachers[1].queue_wait


def test_the_model_card_and_tokenizer_check_take_the_teacher(multi, tmp_path):
    """With several teachers the card (and the tokenizer check) is the named teacher's; both had
    read the first teacher's only."""
    from teacher_server.client import TokenizerMismatch, check_tokenizer, fetch_model_card

    assert fetch_model_card(multi.url)["id"] == "demo"
    for name, vocab in VOCAB.items():
        assert fetch_model_card(multi.url, model=name)["vocab_size"] == vocab
    with pytest.raises(ValueError, match="serves no teacher 'nope'; it serves demo, qwen"):
        fetch_model_card(multi.url, model="nope")
    with pytest.raises(TokenizerMismatch, match=r"larger than the teacher's \(512\)"):
        check_tokenizer(multi.url, tmp_path, vocab_size=1000, model="qwen")


def test_prefix_affinity_within_a_teacher_and_the_async_client(multi):
    """A GRPO group sent to the teacher of two replicas: each member after the first finds the
    prompt cached (the teacher's own router sent it to the replica that holds it); the async
    client chooses the teacher per call too."""
    from teacher_server.client import AsyncTeacherClient

    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB["qwen"], 40)
    with TeacherClient(multi.url) as c:
        outs = []
        for _ in range(4):
            toks = np.concatenate([prompt, rng.integers(0, VOCAB["qwen"], 12)])
            outs.append(c.score_full(toks, rng.integers(0, VOCAB["qwen"], (12, 3)), len(prompt) - 1, model="qwen"))
    assert all(o.cached_tokens >= 32 for o in outs[1:]), [o.cached_tokens for o in outs]

    async def both() -> list[np.ndarray]:
        async with AsyncTeacherClient(multi.url) as ac:
            return await asyncio.gather(*(ac.score(r.token_ids, r.candidates, r.start, model=r.model)
                                          for r in (_requests("demo", 0, 1)[0], _requests("qwen", 1, 1)[0])))

    got = asyncio.run(both())
    with TeacherClient(multi.url) as c:
        for r, g in zip((_requests("demo", 0, 1)[0], _requests("qwen", 1, 1)[0]), got):
            np.testing.assert_allclose(g, c.score(r.token_ids, r.candidates, r.start, model=r.model), atol=TOL, rtol=0)


def test_a_teacher_down_leaves_the_other_serving(multi):
    """Run last (it kills replicas): one of qwen's two replicas down -> degraded (200); demo's
    only replica down -> 503 naming demo, while qwen goes on answering."""
    health = lambda: httpx.get(multi.url + "/health", timeout=10)  # noqa: E731
    first = health().json()
    assert first["status"] == "ready" and set(first["teachers"]) == {"demo", "qwen"}, first
    teachers = {t.cfg.served_name: t for t in multi.app.state.teachers.all}
    qwen_req, demo_req = _requests("qwen", 5, 1)[0], _requests("demo", 5, 1)[0]

    def answers(name: str, r: TeacherRequest) -> int:
        with TeacherClient(multi.url, max_retries=0) as c:
            try:
                c.score(r.token_ids, r.candidates, r.start, model=name)
                return 200
            except TeacherServerError as e:
                return e.status or -1

    os.kill(teachers["qwen"].aengine.pids[1], signal.SIGKILL)
    wait_until(lambda: health().json()["status"] == "degraded", 30, "degraded")
    body = health().json()
    assert health().status_code == 200 and body["teachers"]["qwen"]["replicas_serving"] == 1, body
    assert body["teachers"]["demo"]["status"] == "ready", body
    assert answers("qwen", qwen_req) == 200 and answers("demo", demo_req) == 200

    os.kill(teachers["demo"].aengine.pids[0], signal.SIGKILL)
    wait_until(lambda: health().status_code == 503, 30, "503")
    r = health()
    body = r.json()
    assert body["status"] == "failed" and body["teachers"]["demo"]["status"] == "failed", body
    assert body["error"]["code"] == 503 and "demo" in body["error"]["message"], body
    assert answers("demo", demo_req) == 503
    # the other teacher keeps serving, several requests at once
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(answers("qwen", qwen_req))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 4, codes


def test_a_teacher_ready_answers_while_another_still_loads(demo_server, qwen3_server, tmp_path):
    """One teacher's engine still loading: the other's requests are answered on every endpoint
    (they had all been 503 "engine is loading"); the loading one's are 503, counted under its
    name, and /health names why it is not ready."""
    from teacher_server.engine.engine import Engine

    release = threading.Event()

    def factory(cfg: Config) -> Engine:
        if cfg.served_name == "slow":
            release.wait(120)
        return Engine(cfg)

    cfg = Config(device="cpu", max_num_batched_tokens=512, block_size=8, num_kv_blocks=512, max_model_len=1024,
                 teachers=[{"name": "slow", "demo_model_dir": demo_server.cfg.demo_model_dir, "engine_process": False},
                           {"name": "fast", "model": qwen3_server.cfg.model, "engine_process": False}])
    s = LiveServer(cfg, engine_factory=factory)
    s.thread.start()
    try:
        health = lambda: httpx.get(s.url + "/health", timeout=10)  # noqa: E731
        wait_until(lambda: s.server.started and health().json()["teachers"]["fast"]["status"] == "ready", 120,
                   "fast ready")
        r = health()
        assert r.status_code == 503 and r.json()["status"] == "loading", r.text
        assert r.json()["teachers"]["slow"] == {"status": "loading", "replicas_serving": 0, "replicas": 1,
                                                "message": "engine is loading"}
        ids = np.random.default_rng(7).integers(0, VOCAB["qwen"], 24)
        cands = np.random.default_rng(8).integers(0, VOCAB["qwen"], (23, 4))
        with TeacherClient(qwen3_server.url) as c:
            want = c.score(ids, cands, 0)
        with TeacherClient(s.url, max_retries=0) as c:
            np.testing.assert_allclose(c.score(ids, cands, 0, model="fast"), want, atol=TOL, rtol=0)
            with pytest.raises(TeacherServerError, match="engine is loading") as e:
                c.score(ids, cands, 0, model="slow")
            assert e.value.status == 503
        for path, payload in (("/v1/completions", {"prompt": ids.tolist(), "max_tokens": 0, "prompt_logprobs": 1}),
                              ("/generate", {"input_ids": ids.tolist(), "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 0}})):
            assert httpx.post(s.url + path, json={**payload, "model": "fast"}, timeout=60).status_code == 200, path
            assert httpx.post(s.url + path, json={**payload, "model": "slow"}, timeout=60).status_code == 503, path
        reqs = _series(httpx.get(s.url + "/metrics").text, "teacher_server_requests_total")
        assert reqs['model_name="slow",status="503"'] == 3 and reqs['model_name="fast",status="200"'] == 3, reqs
        release.set()
        wait_until(lambda: health().status_code == 200, 120, "both ready")
    finally:
        release.set()
        s.__exit__()


def test_a_teacher_that_cannot_start_ends_the_service_with_exit_3(qwen3_server, tmp_path):
    """As one teacher's engine does: the orchestrator restarts on a failure (the service had
    exited 0). A teacher whose entry asks for several nodes is refused at start (it had waited
    for worker nodes for ever)."""
    import json
    import shutil
    import subprocess
    import sys

    from test_operations import ServeProcess

    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(os.path.join(qwen3_server.cfg.model, "config.json"), bad / "config.json")  # and no weights
    good = {"name": "good", "model": qwen3_server.cfg.model}
    s = ServeProcess(tmp_path, teachers=json.dumps([good, {"name": "bad", "model": str(bad)}]))
    try:
        assert s.proc.wait(180) == 3, s.proc.stderr.read()[-2000:]
    finally:
        s.kill()
    out = subprocess.run([sys.executable, "-m", "teacher_server", "serve", "--device", "cpu", "--teacher",
                          f"good={qwen3_server.cfg.model}", "--teacher", f"far={qwen3_server.cfg.model},nnodes=2,tensor_parallel_size=2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "teachers[1]: nnodes > 1 spreads one model over hosts" in out.stderr, out.stderr


def test_a_list_of_one_teacher_serves_that_teacher(qwen3_server):
    """A ``teachers`` list of one entry serves that entry's model, with its own settings, under
    its name (it once started the built-in demo model with the service's settings instead)."""
    cfg = Config(device="cpu", max_num_batched_tokens=512, block_size=8, num_kv_blocks=512, max_model_len=1024,
                 teachers=[{"name": "only", "model": qwen3_server.cfg.model, "max_model_len": 100}])
    ids = np.random.default_rng(3).integers(0, VOCAB["qwen"], 24)
    cands = np.random.default_rng(4).integers(0, VOCAB["qwen"], (23, 4))
    with TeacherClient(qwen3_server.url) as c:
        want = c.score(ids, cands, 0)
    with LiveServer(cfg) as s:
        (card,) = httpx.get(s.url + "/v1/models", timeout=30).json()["data"]
        assert card["id"] == "only" and card["vocab_size"] == VOCAB["qwen"] and card["max_model_len"] == 100
        with TeacherClient(s.url) as c:
            np.testing.assert_allclose(c.score(ids, cands, 0, model="only"), want, atol=TOL, rtol=0)


def test_the_teachers_are_shut_down_together():
    """A shutdown takes the slowest teacher's teardown, not their sum (the chart's exit margin
    is one teardown's): each fake engine's shutdown waits for the other's to have begun, which
    one after the other would not happen."""
    from starlette.datastructures import State

    from teacher_server.server.teacher_set import TeacherPools, TeacherSetEngine

    class Slow:
        def __init__(self, started: threading.Event, other: threading.Event) -> None:
            self.started, self.other, self.saw_other = started, other, False

        def shutdown(self) -> None:
            self.started.set()
            self.saw_other = self.other.wait(timeout=10)

    for wrap in ("aengine", "replica_pool"):
        a, b = threading.Event(), threading.Event()
        engines = [Slow(a, b), Slow(b, a)]
        states = []
        for e in engines:
            st = State()
            setattr(st, wrap, e)
            states.append(st)
        (TeacherSetEngine(states) if wrap == "aengine" else TeacherPools(states)).shutdown()
        assert all(e.saw_other for e in engines), wrap


def test_a_teachers_failed_shutdown_is_raised_after_the_others_end():
    from teacher_server.server.teacher_set import all_at_once

    ended = threading.Event()

    def boom() -> None:
        raise RuntimeError("teardown failed")

    with pytest.raises(RuntimeError, match="teardown failed"):
        all_at_once([boom, ended.set])
    assert ended.is_set()


def test_a_request_cut_off_by_the_shutdown_counts_under_its_teacher(multi, monkeypatch):
    """The native endpoint's cut-off 503 is a failure of the teacher the request named (it had
    been counted under the first teacher while its 503 counted under the named one)."""
    from teacher_server.server import generate

    async def cut_off(st, work, info):  # the drain's time ran out once the request named its teacher
        await asyncio.wait({work})
        return False

    def failures() -> dict[str, float]:
        return _series(httpx.get(multi.url + "/metrics").text, "teacher_server_request_failures_total")

    before = failures()
    monkeypatch.setattr(generate, "finished_unless_cut_off", cut_off)
    body = {"token_ids": [1, 2, 3, 4], "model": "qwen", "sampling_params": {"prompt_logprob_token_ids": [[1]] * 3}}
    assert httpx.post(multi.url + "/inference/v1/generate", json=body, timeout=30).status_code == 503
    after = failures()
    key = 'model_name="{}",reason="shutdown"'
    assert after.get(key.format("qwen"), 0) - before.get(key.format("qwen"), 0) == 1, after
    assert after.get(key.format("demo"), 0) == before.get(key.format("demo"), 0), after
