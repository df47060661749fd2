"""The trainer client against the live demo server: both clients, both candidate forms,
batching, padding, errors, and retries through transports that inject 429/502/503/504 or
count requests; the client installs and imports without the server's dependencies."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from email.utils import formatdate
from pathlib import Path

import httpx
import numpy as np
import pytest
from apiutil import body, decode, npy_b64
from conftest import free_port

from teacher_server.client import (
    AsyncTeacherClient,
    PaddedScores,
    ScoreOutput,
    TeacherClient,
    TeacherRequest,
    TeacherServerError,
    pad_scores,
    retry_after_seconds,
)
from teacher_server.client.retry import RetryPolicy

ROOT = Path(__file__).resolve().parents[1]
GEN = "/inference/v1/generate"
VOCAB = 4096
RNG = np.random.default_rng(1234)


def seq(n: int) -> list[int]:
    return RNG.integers(0, VOCAB, n).tolist()


def per_row(rows: int, k: int) -> np.ndarray:
    """[rows, K] distinct ids per row."""
    return np.stack([RNG.choice(VOCAB, k, replace=False) for _ in range(rows)]).astype(np.int32)


def raw_scores(server, token_ids: list[int], cands, start: int) -> np.ndarray:
    """What a plain httpx post with JSON-list candidates returns."""
    with server.client() as c:
        r = c.post(GEN, json=body(token_ids, cands, start=start, max_tokens=0))
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


class _Counting:
    """Counts requests and the peak number in flight; the first ``fail`` requests are
    answered with ``status`` (and ``headers``) instead of being forwarded."""

    def __init__(self, fail: int = 0, status: int = 429, headers: dict[str, str] | None = None,
                 delay: float = 0.0) -> None:
        self.fail, self.status, self.headers, self.delay = fail, status, headers or {}, delay
        self.count = self.inflight = self.peak = 0
        self.lock = threading.Lock()
        self.seen: list[httpx.Request] = []

    def _enter(self, request: httpx.Request) -> httpx.Response | None:
        with self.lock:
            self.count += 1
            self.seen.append(request)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            n = self.count
        if n <= self.fail:
            return httpx.Response(self.status, headers=self.headers, json={"error": {
                "message": "injected", "type": "RateLimitError", "param": None, "code": self.status}})
        return None

    def _exit(self) -> None:
        with self.lock:
            self.inflight -= 1


class CountingTransport(_Counting, httpx.BaseTransport):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            injected = self._enter(request)
            time.sleep(self.delay)
            return injected or self.inner.handle_request(request)
        finally:
            self._exit()

    def close(self) -> None:
        self.inner.close()


class AsyncCountingTransport(_Counting, httpx.AsyncBaseTransport):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            injected = self._enter(request)
            await asyncio.sleep(self.delay)
            return injected or await self.inner.handle_async_request(request)
        finally:
            self._exit()

    async def aclose(self) -> None:
        await self.inner.aclose()


# --- results ------------------------------------------------------------------------------

# Import names of the distributions that only the server needs.
_MODULES = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}


def _server_only_modules() -> list[str]:
    """The import names of the ``server`` extra's packages that the ``client`` extra lacks."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}

    extras = project["optional-dependencies"]
    client = names(project["dependencies"]) | names(extras["client"])
    # the client's install is numpy and httpx; every server package belongs in [server]
    assert client == {"numpy", "httpx"}, client
    server = names(extras["server"]) - client
    assert {"torch", "fastapi", "uvicorn"} <= server, server
    return sorted(_MODULES.get(n, n.replace("-", "_")) for n in server)


def test_client_imports_without_server_dependencies() -> None:
    """``pip install teacher-server[client]`` is enough: with every server-only package made
    unimportable, the client imports and encodes a request, and the ``teacher-server`` command
    says which extra the server needs."""
    blocked = _server_only_modules()
    code = textwrap.dedent(f"""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)  # as if absent
                return None

        sys.meta_path.insert(0, Block())
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("the block does not work")
        import teacher_server, teacher_server.client as c
        c.build_body(c.TeacherRequest([1, 2, 3], [[4, 5], [6, -1]], 0))
        c.pad_scores([])
        print("ok", sorted(m for m in {blocked!r} if m in sys.modules))
        teacher_server.main()  # the command says what to install
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok []", r.stderr[-2000:]
    assert r.returncode == 1 and 'pip install "teacher-server[server]"' in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("form", ["shared", "per_row", "per_row_padded"])
def test_sync_matches_raw_post(demo_server, form: str) -> None:
    toks, start = seq(40), 9
    rows = len(toks) - 1 - start
    if form == "shared":
        cands = RNG.choice(VOCAB, 12, replace=False)
    else:
        cands = per_row(rows, 12)
        if form == "per_row_padded":
            cands[::3, -4:] = -1
    expected = raw_scores(demo_server, toks, cands.tolist(), start)
    with TeacherClient(demo_server.url) as client:
        got = client.score(toks, cands, start)
    assert got.shape == (rows, 12) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    if form == "per_row_padded":
        assert np.isneginf(got[cands == -1]).all() and np.isfinite(got[cands != -1]).all()


def test_a_server_error_pickles_as_it_was() -> None:
    """Across processes (a process pool, Ray): its text was formatted a second time on unpickling."""
    import pickle

    e = TeacherServerError("bad thing", status=400, type="BadRequestError", param="x", code=400, attempts=2)
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) == "400 BadRequestError: bad thing (param: x) [after 2 attempt(s)]"
    assert (back.status, back.type, back.param, back.code, back.attempts) == (400, "BadRequestError", "x", 400, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_takes_a_connection_pool_of_its_own(demo_server) -> None:
    """A client made before a fork (DataLoader workers): parent and child scoring at once over
    one inherited kept-alive socket read each other's answers (the wrong scores, no error, in
    about half the runs). The child now makes its own pool; each side gets its own answers."""
    client = TeacherClient(demo_server.url, max_concurrency=1, max_retries=0, timeout=10)
    mine = {"child": (seq(30), [7]), "parent": (seq(12), [7])}
    want = {k: client.score(*v) for k, v in mine.items()}  # (leaves a kept-alive connection in the pool)
    inherited = id(client._http)
    read, write = os.pipe()
    pid = os.fork()
    side = "child" if pid == 0 else "parent"
    try:
        wrong = 0
        for i in range(20):
            out = client.score_full(*mine[side], request_id=f"{side}-{i}")
            wrong += out.request_id != f"{side}-{i}" or out.scores.shape != want[side].shape or \
                not np.allclose(out.scores, want[side], rtol=0, atol=1e-4)  # (batched with the other side's)
        own_pool = id(client._http) != inherited
    except Exception as e:  # (the child must report, whatever happens)
        wrong, own_pool = repr(e)[:200], None
    if pid == 0:
        os.write(write, json.dumps([wrong, own_pool]).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child_wrong, child_own = json.loads(os.read(read, 4096))
    client.close()
    assert (wrong, own_pool) == (0, False) and (child_wrong, child_own) == (0, True)


@pytest.mark.parametrize("form", ["shared", "per_row"])
def test_async_matches_sync(demo_server, form: str) -> None:
    toks, start = seq(33), 4
    cands = [5, 17, 99, 3000] if form == "shared" else per_row(len(toks) - 1 - start, 4).tolist()

    async def go() -> np.ndarray:
        async with AsyncTeacherClient(demo_server.url) as client:
            return await client.score(toks, cands, start)

    got = asyncio.run(go())
    with TeacherClient(demo_server.url) as client:
        expected = client.score(np.asarray(toks), np.asarray(cands), start)
    assert got.shape == (28, 4) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_zero_rows(demo_server) -> None:
    toks = seq(6)

    async def go() -> list[np.ndarray]:
        async with AsyncTeacherClient(demo_server.url) as client:
            return [await client.score(toks, [1, 2, 3], start=5),
                    await client.score(toks, np.zeros((0, 3), np.int32), start=5)]

    with TeacherClient(demo_server.url) as client:
        results = [client.score(toks, [1, 2, 3], start=5), client.score(toks, np.zeros((0, 3), np.int32), start=5),
                   client.score(toks, [7], start=50), client.score([42], [1, 2, 3])]
    results += asyncio.run(go())
    for r in results:
        assert r.dtype == np.float32 and r.shape[0] == 0 and r.shape[1] in (1, 3)


def test_score_full(demo_server) -> None:
    toks = seq(20)
    with TeacherClient(demo_server.url) as client:
        out = client.score_full(toks, [1, 2], 3, request_id="req-full-1", prompt_logprobs=2, max_tokens=1,
                                cache_salt="full")
        again = client.score_full(toks, [1, 2], 3, cache_salt="full")
    assert isinstance(out, ScoreOutput)
    assert out.scores.shape == (16, 2) and out.request_id == "req-full-1" and out.model
    assert out.next_token is not None and 0 <= out.next_token < VOCAB and again.next_token is None
    assert out.prompt_tokens == 20 and isinstance(out.cached_tokens, int)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 20 and out.prompt_logprobs[0] is None
    assert next(iter(out.prompt_logprobs[1])) == str(toks[1])  # the actual token comes first
    assert again.prompt_logprobs is None and again.request_id != "req-full-1"
    np.testing.assert_allclose(again.scores, out.scores, rtol=0, atol=1e-5)


def test_candidates_are_sent_in_binary_form_with_auth() -> None:
    seen: list[httpx.Request] = []
    matrix = np.arange(6, dtype=np.float32).reshape(3, 2)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"request_id": "r", "model": "m", "created": 0,
                                         "choices": [{"index": 0, "token_ids": [], "finish_reason": "length",
                                                      "logprobs": None}],
                                         "usage": {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4,
                                                   "prompt_tokens_details": {"cached_tokens": 0}},
                                         "prompt_token_id_logprobs": npy_b64(matrix)})

    with TeacherClient("http://teacher.invalid", api_key="sk-1", transport=httpx.MockTransport(handler)) as c:
        got = c.score([1, 2, 3, 4], [[1, 2], [3, -1], [5, 6]], 0)
    with TeacherClient("http://teacher.invalid", transport=httpx.MockTransport(handler)) as c:
        c.score(np.array([1, 2, 3, 4], np.int64), np.array([9, 8], np.int64))
    np.testing.assert_array_equal(got, matrix)
    assert seen[0].headers["authorization"] == "Bearer sk-1" and "authorization" not in seen[1].headers
    for req, shape in zip(seen, [(3, 2), (2,)]):
        sp = json.loads(req.content)["sampling_params"]
        cands = decode(sp["prompt_logprob_token_ids"])  # a base64 .npy string, never a JSON list
        assert cands.dtype == np.dtype("<i4") and cands.shape == shape
    assert decode(json.loads(seen[0].content)["sampling_params"]["prompt_logprob_token_ids"]).tolist() == \
        [[1, 2], [3, -1], [5, 6]]


@pytest.mark.parametrize("status,retried", [(502, True), (504, True), (403, False)])
def test_error_without_the_error_shape(status: int, retried: bool) -> None:
    """A proxy's page is reported as it came; an ingress's 502/504 is retried, a 403 is not."""
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(status, text=f"<html>proxy says {status}</html>")

    with TeacherClient("http://teacher.invalid", max_retries=2, backoff=0.01,
                       transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(TeacherServerError) as ei:
            c.score([1, 2, 3], [1, 2])
    e = ei.value
    assert e.status == status and e.type is None and f"proxy says {status}" in e.message
    assert len(calls) == e.attempts == (3 if retried else 1)


def _never_called(request: httpx.Request) -> httpx.Response:
    raise AssertionError("nothing may be sent for input that cannot be valid")


@pytest.mark.parametrize("cands,error,match", [
    ([1.5, 2.0], TypeError, "integer"),
    (np.zeros((1, 2, 2), np.int32), ValueError, r"\[K\] or \[rows, K\]"),
    ([2 ** 40], ValueError, "int32"),
    ([], ValueError, "K must be at least 1"),  # K == 0: the server's 400, before sending
    (np.zeros(0, np.int32), ValueError, "K must be at least 1"),
    (np.zeros((2, 0), np.int64), ValueError, "K must be at least 1"),
    ([[1, 2], [3, 4, 5]], ValueError, "row 0 has 2, row 1 has 3"),  # ragged rows
    ([[1, 2], [3]], ValueError, "pad with -1"),
    ([[1, 2], 3], ValueError, "a mix of ids and rows"),
])
def test_local_input_errors(cands, error, match) -> None:
    """Input the server would refuse is refused before sending, by both clients."""
    with TeacherClient("http://teacher.invalid", transport=httpx.MockTransport(_never_called)) as c:
        with pytest.raises(error, match=match):
            c.score([1, 2, 3], cands, start=1)

    async def go() -> None:
        async with AsyncTeacherClient("http://teacher.invalid", transport=httpx.MockTransport(_never_called)) as c:
            await c.score([1, 2, 3], cands, start=1)

    with pytest.raises(error, match=match):
        asyncio.run(go())


# --- batches ------------------------------------------------------------------------------

def _batch(n: int) -> tuple[list, list[int]]:
    """n requests of different lengths (so a mix-up would show in the shapes), in the three
    accepted forms."""
    reqs, rows = [], []
    for i in range(n):
        toks, start = seq(30 + 7 * i), 5
        r = len(toks) - 1 - start
        cands = per_row(r, 3)
        reqs.append([TeacherRequest(toks, cands, start), dict(token_ids=toks, candidates=cands, start=start),
                     (toks, cands, start)][i % 3])
        rows.append(r)
    return reqs, rows


def test_score_batch_order_and_concurrency(demo_server) -> None:
    reqs, rows = _batch(12)
    transport = CountingTransport(delay=0.05)
    with TeacherClient(demo_server.url, max_concurrency=3, transport=transport) as client:
        results = client.score_batch(reqs, progress=True)
        singles = [client.score(*r) for r in reqs if isinstance(r, tuple)]
    assert [r.shape for r in results] == [(n, 3) for n in rows]
    for got, want in zip([r for r, q in zip(results, reqs) if isinstance(q, tuple)], singles):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert transport.count == 12 + len(singles)
    assert 2 <= transport.peak <= 3, transport.peak
    with TeacherClient(demo_server.url) as client:
        assert client.score_batch([]) == []


def test_async_score_batch_order_and_concurrency(demo_server) -> None:
    reqs, rows = _batch(10)
    transport = AsyncCountingTransport(delay=0.05)

    async def go() -> list[np.ndarray]:
        async with AsyncTeacherClient(demo_server.url, max_concurrency=4, transport=transport) as client:
            return await client.score_batch(reqs)

    results = asyncio.run(go())
    assert [r.shape for r in results] == [(n, 3) for n in rows]
    assert transport.count == 10 and 2 <= transport.peak <= 4, transport.peak


def test_progress_without_tqdm(demo_server, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails: the stderr counter is used
    reqs, _ = _batch(3)
    with TeacherClient(demo_server.url) as client:
        assert len(client.score_batch(reqs, progress=True)) == 3
    assert "3/3" in capsys.readouterr().err


def test_score_batch_raises_first_failure(demo_server) -> None:
    reqs, _ = _batch(4)
    reqs[2] = TeacherRequest(seq(10), [3, VOCAB])  # an id outside the vocabulary: 400
    with TeacherClient(demo_server.url, max_concurrency=2) as client, pytest.raises(TeacherServerError) as ei:
        client.score_batch(reqs)
    assert ei.value.status == 400

    async def go() -> None:
        async with AsyncTeacherClient(demo_server.url, max_concurrency=2) as client:
            await client.score_batch(reqs)

    with pytest.raises(TeacherServerError) as ei:
        asyncio.run(go())
    assert ei.value.status == 400


def test_score_batch_return_exceptions(demo_server) -> None:
    """Every request runs; failed ones hold their error in place, the others their result."""
    reqs, rows = _batch(5)
    reqs[1] = TeacherRequest(seq(10), [3, VOCAB])  # the server's 400
    reqs[3] = TeacherRequest(seq(10), [])  # refused before sending
    with TeacherClient(demo_server.url, max_concurrency=2) as client:
        sync = client.score_batch(reqs, return_exceptions=True)

    async def go() -> list:
        async with AsyncTeacherClient(demo_server.url, max_concurrency=2) as client:
            return await client.score_batch(reqs, return_exceptions=True)

    for results in (sync, asyncio.run(go())):
        assert isinstance(results[1], TeacherServerError) and results[1].status == 400
        assert isinstance(results[3], ValueError) and "K must be at least 1" in str(results[3])
        for i in (0, 2, 4):
            assert isinstance(results[i], np.ndarray) and results[i].shape == (rows[i], 3)
    for i in (0, 2, 4):
        np.testing.assert_allclose(sync[i], results[i], rtol=0, atol=1e-5)


def test_pad_scores() -> None:
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.array([[-np.inf, 7.0]], np.float32)
    out = pad_scores([a, b, np.zeros((0, 2), np.float32)])
    assert isinstance(out, PaddedScores) and out.scores.shape == (3, 3, 2) and out.scores.dtype == np.float32
    np.testing.assert_array_equal(out.mask, [[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(out.scores[0], a)
    np.testing.assert_array_equal(out.scores[1], [[-np.inf, 7.0], [0, 0], [0, 0]])  # -1 padding kept, rows filled
    assert not out.scores[2].any()
    wide = pad_scores([a, b], length=5, fill=-1.0)
    assert wide.scores.shape == (2, 5, 2) and wide.mask.sum() == 4 and (wide.scores[1, 1:] == -1.0).all()
    with pytest.raises(ValueError, match="shorter"):
        pad_scores([a], length=2)
    with pytest.raises(ValueError, match="different K"):
        pad_scores([a, np.zeros((1, 3), np.float32)])
    with pytest.raises(ValueError, match="return_tensors"):
        pad_scores([a], return_tensors="tf")  # type: ignore[arg-type]
    assert pad_scores([]).scores.shape == (0, 0, 0)
    vec = pad_scores([np.array([-1.0, -2.0], np.float32), np.array([-3.0], np.float32)])  # actual_logprobs and co.
    np.testing.assert_array_equal(vec.scores, [[-1.0, -2.0], [-3.0, 0.0]])
    np.testing.assert_array_equal(vec.mask, [[1, 1], [1, 0]])
    with pytest.raises(ValueError, match="all \\[rows, K\\] matrices or all \\[rows\\] vectors"):
        pad_scores([a, np.zeros(3, np.float32)])


def test_score_batch_padded(demo_server) -> None:
    import torch

    reqs, rows = _batch(4)
    with TeacherClient(demo_server.url) as client:
        singles = client.score_batch(reqs)
        out = client.score_batch_padded(reqs)

    async def go() -> PaddedScores:
        async with AsyncTeacherClient(demo_server.url) as client:
            return await client.score_batch_padded(reqs, length=max(rows) + 2, return_tensors="pt")

    pt = asyncio.run(go())
    assert out.scores.shape == (4, max(rows), 3) and out.mask.shape == (4, max(rows))
    assert isinstance(pt.scores, torch.Tensor) and pt.scores.dtype == torch.float32 and pt.mask.dtype == torch.bool
    assert tuple(pt.scores.shape) == (4, max(rows) + 2, 3)
    for b, (n, one) in enumerate(zip(rows, singles)):
        assert out.mask[b].sum() == n and pt.mask[b].sum().item() == n
        np.testing.assert_allclose(out.scores[b, :n], one, rtol=0, atol=1e-5)
        np.testing.assert_allclose(pt.scores[b, :n].numpy(), one, rtol=0, atol=1e-5)
        assert not out.scores[b, n:].any()


def test_async_client_across_event_loops(demo_server) -> None:
    """One client, built outside any loop, serves successive asyncio.run calls."""
    toks, cands = seq(20), [1, 2, 3]
    client = AsyncTeacherClient(demo_server.url, max_concurrency=2)

    async def go() -> list[np.ndarray]:
        return list(await asyncio.gather(*(client.score(toks, cands, 4) for _ in range(3))))

    first = asyncio.run(go())  # no aclose: this loop's connections are dropped with it
    second = asyncio.run(go())

    async def last() -> np.ndarray:
        async with client:
            return (await client.score_batch([(toks, cands, 4)]))[0]

    third = asyncio.run(last())
    for m in first + second + [third]:
        assert m.shape == (15, 3)
        np.testing.assert_allclose(m, first[0], rtol=0, atol=1e-5)


# --- errors and retries -------------------------------------------------------------------

def test_bad_request_is_not_retried(demo_server) -> None:
    transport = CountingTransport()
    with TeacherClient(demo_server.url, max_retries=5, backoff=0.01, transport=transport) as client:
        with pytest.raises(TeacherServerError) as ei:
            client.score(seq(10), [[1, VOCAB], [2, 3]], start=7)
    e = ei.value
    assert (e.status, e.type, e.code, e.param) == (400, "BadRequestError", 400,
                                                   "sampling_params.prompt_logprob_token_ids")
    assert "outside" in e.message and e.attempts == 1 and transport.count == 1

    async_transport = AsyncCountingTransport()

    async def go() -> None:
        async with AsyncTeacherClient(demo_server.url, max_retries=5, backoff=0.01,
                                      transport=async_transport) as client:
            await client.score([1, VOCAB], [1, 2])

    with pytest.raises(TeacherServerError) as ei:
        asyncio.run(go())
    assert ei.value.status == 400 and ei.value.param == "token_ids" and async_transport.count == 1


def test_wrong_model_is_404_not_retried(demo_server) -> None:
    transport = CountingTransport()
    with TeacherClient(demo_server.url, model="no-such-model", transport=transport) as client:
        with pytest.raises(TeacherServerError) as ei:
            client.score(seq(5), [1, 2])
    assert ei.value.status == 404 and ei.value.type == "NotFoundError" and transport.count == 1


def test_retry_after_429_is_the_least_wait(demo_server) -> None:
    toks, cands = seq(25), [4, 5, 6]
    transport = CountingTransport(fail=2, status=429, headers={"Retry-After": "1"})
    t0 = time.monotonic()
    with TeacherClient(demo_server.url, max_retries=3, backoff=0.01, transport=transport) as client:
        got = client.score(toks, cands, 2)
    assert 2.0 <= time.monotonic() - t0 < 20  # two waits of at least the server's 1 s, not the 0.01 s backoff
    assert transport.count == 3  # two injected 429s, then the real answer
    np.testing.assert_allclose(got, raw_scores(demo_server, toks, cands, 2), rtol=0, atol=1e-5)


def test_retry_waits_grow_past_a_constant_retry_after() -> None:
    """A server that keeps answering 429 with ``Retry-After: 1`` through a long overload: the
    waits still grow (exponential, jittered, at least the hint, capped), so the retries span
    more than the hint times their number."""
    policy = RetryPolicy(max_retries=5, backoff=0.5, max_backoff=30.0)
    busy = httpx.Response(429, headers={"Retry-After": "1"})
    for _ in range(200):
        waits = [policy.delay(a, busy) for a in range(1, 7)]
        assert all(1.0 <= w <= 30.0 for w in waits)
        assert waits[4] >= 4.0 and waits[5] >= 8.0  # 0.5 * 2**4 = 8 s, half of it fixed
        assert sum(waits) >= 1.0 * 6 + 5
    capped = RetryPolicy(max_retries=5, backoff=0.5, max_backoff=2.0)
    assert capped.delay(1, httpx.Response(503, headers={"Retry-After": "60"})) == 2.0
    assert policy.delay(1, httpx.Response(503)) <= 0.5  # no hint: the backoff alone


def test_retry_after_503_then_success_async(demo_server) -> None:
    transport = AsyncCountingTransport(fail=2, status=503)  # no Retry-After: exponential backoff

    async def go() -> np.ndarray:
        async with AsyncTeacherClient(demo_server.url, max_retries=2, backoff=0.01, transport=transport) as c:
            return await c.score(seq(12), [1, 2], 3)

    assert asyncio.run(go()).shape == (8, 2) and transport.count == 3


@pytest.mark.parametrize("status", [502, 504])
def test_ingress_errors_are_retried(demo_server, status: int) -> None:
    """An ingress in front of the server answers 502/504 when it loses the upstream."""
    toks, cands = seq(14), [4, 5]
    transport = CountingTransport(fail=2, status=status)
    with TeacherClient(demo_server.url, max_retries=2, backoff=0.01, transport=transport) as client:
        got = client.score(toks, cands, 3)
    assert transport.count == 3
    np.testing.assert_allclose(got, raw_scores(demo_server, toks, cands, 3), rtol=0, atol=1e-5)

    async_transport = AsyncCountingTransport(fail=1, status=status)

    async def go() -> np.ndarray:
        async with AsyncTeacherClient(demo_server.url, max_retries=1, backoff=0.01, transport=async_transport) as c:
            return await c.score(toks, cands, 3)

    assert asyncio.run(go()).shape == (10, 2) and async_transport.count == 2


def test_retries_exhausted_raise_last_status(demo_server) -> None:
    transport = CountingTransport(fail=10, status=503, headers={"Retry-After": "0"})
    with TeacherClient(demo_server.url, max_retries=2, transport=transport) as client:
        with pytest.raises(TeacherServerError) as ei:
            client.score(seq(5), [1, 2])
    assert ei.value.status == 503 and ei.value.attempts == 3 and transport.count == 3


def test_connection_refused_retries_then_raises() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens here
    transport = CountingTransport()
    with TeacherClient(url, max_retries=2, backoff=0.01, transport=transport) as client:
        with pytest.raises(TeacherServerError) as ei:
            client.score([1, 2, 3], [1, 2])
    assert ei.value.status is None and ei.value.type == "ConnectError" and ei.value.attempts == 3
    assert transport.count == 3 and isinstance(ei.value.__cause__, httpx.ConnectError)

    async_transport = AsyncCountingTransport()

    async def go() -> None:
        async with AsyncTeacherClient(url, max_retries=1, backoff=0.01, transport=async_transport) as c:
            await c.score([1, 2, 3], [1, 2])

    with pytest.raises(TeacherServerError) as ei:
        asyncio.run(go())
    assert ei.value.attempts == 2 and async_transport.count == 2


def test_retry_after_parsing() -> None:
    def parsed(value: str | None) -> float | None:
        return retry_after_seconds(httpx.Response(429, headers={} if value is None else {"Retry-After": value}))

    assert parsed("3") == 3.0 and parsed("0") == 0.0 and parsed(None) is None and parsed("soon") is None
    assert parsed("nan") is None and parsed("-5") == 0.0 and parsed("inf") == float("inf")  # (capped by the policy)
    assert 50 < parsed(formatdate(time.time() + 60, usegmt=True)) <= 61
    assert parsed(formatdate(time.time() - 60, usegmt=True)) == 0.0


# --- the example --------------------------------------------------------------------------

def test_distill_step_example(demo_server, tmp_path) -> None:
    script = ROOT / "examples" / "distill_step.py"
    r = subprocess.run([sys.executable, str(script), "--url", demo_server.url, "--prompts", "2", "--group", "3",
                        "--prompt-len", "40", "--response-len", "24", "-k", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "scored 6 rollouts (144 response tokens, K=8)" in r.stdout and "forward KL" in r.stdout

    # The same step from a rollouts file, through main().
    sys.path.insert(0, str(script.parent))
    try:
        import distill_step
    finally:
        sys.path.remove(str(script.parent))
    rollouts = distill_step.random_rollouts(1, 2, 10, 6, 4, VOCAB, seed=3)
    rollouts[0].student_topk_ids[1, -1] = -1  # a padded candidate
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                                        "student_topk_ids": r.student_topk_ids.tolist(),
                                        "student_topk_logprobs": r.student_topk_logprobs.tolist()}) + "\n"
                            for r in rollouts))
    summary = distill_step.main(["--url", demo_server.url, "--rollouts", str(path)])
    assert summary["rollouts"] == 2 and summary["scored_tokens"] == 12
    assert np.isfinite(summary["loss"]) and summary["loss"] >= 0


def test_distill_loss_properties() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from distill_step import distill_loss
    finally:
        sys.path.remove(str(ROOT / "examples"))
    ids = np.array([[1, 2, 3], [4, 5, -1]])
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 1.0]]))
    teacher = np.where(ids >= 0, lp - 1.0, -np.inf)  # same distribution once renormalised over K
    np.testing.assert_allclose(distill_loss(teacher, lp, ids), 0.0, atol=1e-12)
    student = np.log(np.array([[0.2, 0.3, 0.5], [0.5, 0.5, 1.0]]))
    loss = distill_loss(teacher, student, ids)
    want0 = np.sum([0.5, 0.3, 0.2] * np.log(np.array([0.5, 0.3, 0.2]) / [0.2, 0.3, 0.5]))
    want1 = 0.6 * np.log(0.6 / 0.5) + 0.4 * np.log(0.4 / 0.5)
    np.testing.assert_allclose(loss, [want0, want1], rtol=1e-12)


def test_async_batch_sends_its_first_requests_before_encoding_the_rest(monkeypatch) -> None:
    """A batch's bodies are encoded as slots free up: the first requests go out while the
    others wait, instead of after every body of the batch has been encoded."""
    events: list[str] = []
    orig = AsyncTeacherClient._encode

    def encode(self, req):
        events.append("encode")
        return orig(self, req)

    async def handler(request: httpx.Request) -> httpx.Response:
        events.append("sent")
        await asyncio.sleep(0.05)  # the network and the server
        events.append("answered")
        return httpx.Response(403, json={"error": {"message": "no", "type": "forbidden", "code": 403}})

    monkeypatch.setattr(AsyncTeacherClient, "_encode", encode)

    async def go() -> list:
        async with AsyncTeacherClient("http://teacher.invalid", max_concurrency=2,
                                      transport=httpx.MockTransport(handler)) as client:
            return await client.score_batch([([1, 2, 3], [1, 2])] * 10, return_exceptions=True)

    out = asyncio.run(go())
    assert len(out) == 10 and all(isinstance(e, TeacherServerError) for e in out)
    assert events.count("encode") == 10 and events.count("sent") == 10
    # two slots: two bodies encoded and sent; the others only as answers free the slots
    assert events[:events.index("answered")].count("encode") == 2


# --- failures that are not the server's error shape, batches given up -----------------------

def _ok_body(rows: int, k: int) -> bytes:
    return json.dumps({"request_id": "x", "model": "m", "created": 0,
                       "choices": [{"index": 0, "token_ids": [], "finish_reason": "length", "logprobs": None}],
                       "prompt_token_id_logprobs": npy_b64(np.zeros((rows, k), np.float32))}).encode()


@pytest.mark.parametrize(("headers", "content", "kind"), [
    ({"content-type": "text/html"}, b"<html>sign in</html>", "invalid_response"),
    ({"content-type": "application/json"}, b"[1, 2]", "invalid_response"),
    ({"content-type": "application/json"}, b'{"prompt_token_id_logprobs": "bm90IGFuIG5weQ=="}', "invalid_response"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, b"not gzip", "DecodingError"),
])
def test_an_answer_that_is_not_a_scoring_answer_raises_teacher_server_error(headers, content, kind) -> None:
    """A 200 from something else (a proxy's page, a truncated or mangled body) fails as every
    other failure does, with ``TeacherServerError``, once (not retried)."""
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, headers=headers, content=content)

    with TeacherClient("http://teacher.test", transport=httpx.MockTransport(answer), max_retries=3) as c:
        with pytest.raises(TeacherServerError) as ei:
            c.score([1, 2, 3], [4])
    assert ei.value.type == kind and len(calls) == 1

    async def go() -> None:
        async with AsyncTeacherClient("http://teacher.test", transport=httpx.MockTransport(answer)) as c:
            await c.score([1, 2, 3], [4])

    with pytest.raises(TeacherServerError):
        asyncio.run(go())


def test_a_failed_batch_raises_at_once_not_after_the_slow_requests() -> None:
    """The first failure of a sync batch is raised when it happens; requests still being sent
    are not waited for (and are not sent again)."""
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if json.loads(request.content)["token_ids"][0] == 99:
            return httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError", "param": None,
                                                       "code": 400}})
        time.sleep(3.0)
        return httpx.Response(503, headers={"Retry-After": "0"})  # (would be retried, were the batch going on)

    with TeacherClient("http://teacher.test", transport=httpx.MockTransport(answer), max_concurrency=4,
                       backoff=0.01) as c:
        t0 = time.monotonic()
        with pytest.raises(TeacherServerError) as ei:
            c.score_batch([([1, 2, 3], [4]), ([1, 2, 3], [4]), ([99, 2, 3], [4]), ([1, 2, 3], [4])])
        assert time.monotonic() - t0 < 2.0 and ei.value.status == 400
        time.sleep(3.5)  # the slow ones end: none is sent again (one not started yet is not sent at all)
    assert 3 <= len(calls) <= 4


def test_a_transport_factory_gives_each_event_loop_its_own() -> None:
    """Loops in two threads at once: with a factory each loop has its own transport."""
    made = []

    def factory() -> httpx.AsyncBaseTransport:
        made.append(1)

        async def answer(request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(0.005)
            return httpx.Response(200, content=_ok_body(2, 1))

        return httpx.MockTransport(answer)

    client = AsyncTeacherClient("http://teacher.test", transport=factory, max_retries=0, max_concurrency=4)
    errors = []

    def worker(n: int) -> None:
        async def main() -> None:
            for _ in range(n):
                assert [m.shape for m in await client.score_batch([([1, 2, 3], [4])] * 4)] == [(2, 1)] * 4

        try:
            asyncio.run(main())
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in (3, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(made) == 2


def test_no_timeout_means_no_limit_but_on_connecting() -> None:
    with TeacherClient("http://teacher.test", timeout=None) as c:
        t = c._http.timeout
    assert t.read is None and t.write is None and t.connect == 10.0


def test_async_with_stops_the_health_checks_and_a_later_use_starts_them_again() -> None:
    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_ok_body(2, 1))

    client = AsyncTeacherClient(["http://a.test", "http://b.test"], transport=httpx.MockTransport(answer),
                                health_interval=3600)

    async def use() -> None:
        async with client:
            await client.score([1, 2, 3], [4])
            assert client.endpoints._thread is not None and client.endpoints._thread.is_alive()

    asyncio.run(use())
    assert client.endpoints._thread is None  # stopped with `async with`
    asyncio.run(use())  # used again: running again while in use
    assert client.endpoints._thread is None


def test_a_given_up_batch_does_not_hold_the_interpreter_exit(tmp_path) -> None:
    """A request of a failed batch still waiting on an answer (its server silent) must not keep
    the trainer's process from exiting: the batch's threads are daemons."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent('''
        import json, threading
        import httpx
        from teacher_server.client import TeacherClient, TeacherServerError

        never = threading.Event()

        def answer(request):
            if json.loads(request.content)["token_ids"][0] == 99:
                return httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError",
                                                           "param": None, "code": 400}})
            never.wait()  # a server that never answers

        with TeacherClient("http://teacher.test", transport=httpx.MockTransport(answer), max_concurrency=2) as c:
            try:
                c.score_batch([([1, 2, 3], [4]), ([99, 2, 3], [4])])
            except TeacherServerError as e:
                print("raised", e.status)
    '''))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "raised 400" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize(("kwargs", "name"), [({"start": 1.5}, "start"), ({"start": "4"}, "start"),
                                              ({"start": True}, "start"), ({"max_tokens": 0.9}, "max_tokens"),
                                              ({"prompt_logprobs": 2.7}, "prompt_logprobs"),
                                              ({"priority": 0.5}, "priority")])
def test_a_value_the_server_would_refuse_raises_before_sending(kwargs: dict, name: str) -> None:
    """int(1.5) would quietly score other rows than asked; the server answers these with a 400."""
    from teacher_server.client.protocol import build_body

    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        build_body(TeacherRequest([1, 2, 3, 4], [5], **kwargs))
    assert build_body(TeacherRequest([1, 2, 3, 4], [5], start=np.int64(2)))["sampling_params"]["prompt_logprob_start"] == 2


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (("http://127.0.0.1:1",), {"max_concurrency": 0}, "max_concurrency"),
    (("http://127.0.0.1:1",), {"max_retries": -1}, "max_retries"),
    (("http://127.0.0.1:1",), {"routing": "random"}, "routing"),
    (([],), {}, "at least one base URL"),
    (("ftp://127.0.0.1:1",), {}, "http:// or https://"),
    (("127.0.0.1:8000",), {}, "http:// or https://")])
def test_bad_client_settings_are_value_errors(args: tuple, kwargs: dict, match: str) -> None:
    """ValueError at construction (not an assert, which python -O drops: max_concurrency=0 then hung)."""
    with pytest.raises(ValueError, match=match):
        TeacherClient(*args, **kwargs)


def test_spaces_around_a_base_url_are_dropped() -> None:
    assert TeacherClient(" http://127.0.0.1:1/ ").base_url == "http://127.0.0.1:1"


def test_an_unsigned_id_past_int64_is_named_not_wrapped() -> None:
    """2**64 - 1 cast to int64 would travel as -1 and come back as the server's 'id -1'."""
    from teacher_server.client.protocol import build_body

    with pytest.raises(ValueError, match=f"id {2**64 - 1} is out of range"):
        build_body(TeacherRequest(np.array([1, 2**64 - 1], dtype=np.uint64), [5]))
