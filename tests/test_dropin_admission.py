"""The trainers' endpoints (``/v1/completions``, SGLang's ``/generate``) admitted as the native
one is: the in-flight byte budget (the body while it is read, the answer until it is sent),
the queue's estimated wait, the ``X-Request-Timeout`` deadline and the priority range."""

from __future__ import annotations

import time

import numpy as np
import orjson
import pytest
from apiutil import assert_error
from conftest import LiveServer, wait_until

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.server.byte_budget import ByteBudget, Hold, over_budget
from teacher_server.server.sglang_generate import parse_sglang
from teacher_server.validation import Limits

ENDPOINTS = ("/v1/completions", "/generate")


def scoring_body(path: str, ids: list[int], k: int) -> dict:
    """A teacher-scoring call of endpoint ``path``: top-``k`` log-probs at every position."""
    if path == "/v1/completions":
        return {"prompt": ids, "max_tokens": 0, "prompt_logprobs": k}
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": k}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Small steps (a long prompt takes seconds) and a byte budget of 16 KiB (below what the
    command line accepts: set on the running server)."""
    cfg = Config(demo_model_dir=str(tmp_path_factory.mktemp("demo") / "m"), device="cpu",
                 max_num_batched_tokens=16, num_kv_blocks=2048, max_model_len=8192, max_logprobs=64,
                 max_prompt_logprobs_entries=10 ** 6)
    with LiveServer(cfg) as s:
        s.app.state.byte_budget.limit = 16 * 1024
        yield s


@pytest.mark.parametrize("path", ENDPOINTS)
def test_byte_budget_refuses_large_bodies_and_answers(server, path: str) -> None:
    """With bytes of another request held, a body too large for the rest of the budget is
    refused before it is read, and a small body whose answer (JSON entries) would not fit is
    refused once parsed: 429 with Retry-After. Alone, both run; every byte is given back."""
    budget: ByteBudget = server.app.state.byte_budget
    big = scoring_body(path, [1000 + i % 3000 for i in range(2000)], 0)  # 10 KB of JSON: twice that read and parsed
    wide = scoring_body(path, list(range(1, 200)), 20)  # a small body; ~200 x 21 entries of answer
    with server.client() as c:
        budget.take(1)  # another request's bytes in flight
        try:
            for b in (big, wide):
                r = c.post(path, json=b)
                assert_error(r, 429, contains="max_inflight_bytes")
                assert int(r.headers["Retry-After"]) >= 1
        finally:
            budget.give(1)
        for b in (big, wide):
            assert c.post(path, json=b).status_code == 200
        wait_until(lambda: budget.used == 0, 3, "the budget given back")
        assert budget.peak > budget.limit  # (one request alone may exceed it)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_long_estimated_wait_is_refused(server, path: str) -> None:
    queue = server.app.state.queue_wait
    queue.refuse = lambda priority: 7.2  # the work ahead would take 7.2 s more than allowed
    try:
        with server.client() as c:
            r = c.post(path, json=scoring_body(path, [1, 2, 3], 1))
        assert_error(r, 429, contains="queue too long")
        assert r.headers["Retry-After"] == "8"
    finally:
        del queue.refuse
    assert queue.queued == 0


@pytest.mark.parametrize("path", ENDPOINTS)
def test_deadline_header_gets_504_and_the_work_dropped(server, path: str) -> None:
    engine: Engine = server.app.state.engine
    ids = np.random.default_rng(0).integers(0, 4096, 8000).tolist()  # 500 steps of 16 tokens: many seconds
    with server.client() as c:
        t0 = time.monotonic()
        r = c.post(path, json=scoring_body(path, ids, 0), headers={"X-Request-Timeout": "1"})
        assert_error(r, 504, contains="deadline")
        assert time.monotonic() - t0 < 1 + 3
        wait_until(lambda: engine.stats().active_requests == 0, 3, "the request's removal")
        assert engine.stats().kv_blocks_used == 0 and server.app.state.queue_wait.queued == 0
        for bad in ("abc", "0", "-1", "nan"):
            assert_error(c.post(path, json=scoring_body(path, [1, 2, 3], 1), headers={"X-Request-Timeout": bad}),
                         400, "x-request-timeout")
        assert c.post(path, json=scoring_body(path, [1, 2, 3], 1), headers={"X-Request-Timeout": "30"}).status_code \
            == 200


@pytest.mark.parametrize("path", ENDPOINTS)
def test_priority_range(server, path: str) -> None:
    with server.client() as c:
        for p in (-1000, 1000):
            assert c.post(path, json=scoring_body(path, [1, 2, 3], 1) | {"priority": p}).status_code == 200
        for p in (1001, -1001, 2 ** 63):
            assert_error(c.post(path, json=scoring_body(path, [1, 2, 3], 1) | {"priority": p}), 400, "priority",
                         contains=f"[-1000, 1000] (priority_limit), got {p}")


def test_sglang_priority_order_is_negated() -> None:
    """SGLang runs larger priorities earlier (its default); the queue here runs lower ones
    earlier: an SGLang client's urgent request stays urgent."""
    limits = Limits(vocab_size=64, max_model_len=64, max_logprobs=8, max_rows_x_k=10 ** 6, priority_limit=1000)
    for sent, queued in ((5, -5), (-3, 3), (None, 0)):
        body = {"input_ids": [[1, 2, 3], [4, 5]]} | ({} if sent is None else {"priority": sent})
        assert [r.priority for r in parse_sglang(orjson.dumps(body), limits, "m", None).reqs] == [queued, queued]


def test_a_hold_alone_grows_past_the_budget() -> None:
    """A request alone may take more than the whole budget, also when its share grows (from
    its body to its answer); beside another request's bytes it may not."""
    b = ByteBudget(100)
    h = Hold(b)
    assert h.take(150) and h.resize(400) and b.used == 400
    other = Hold(b)
    assert not other.take(1)
    h.release()
    assert other.take(1) and not h.take(100) and h.take(99) and not h.resize(500) and b.used == 100
    # the refusal says why retrying under traffic does not help a request larger than the budget
    big, busy = str(over_budget(h, 300 << 20)), str(over_budget(h, 50))
    assert "more than the whole" in big and "raise max_inflight_bytes" in big and "whole" not in busy
    mib = ByteBudget(100 << 20)  # what others hold, not counting the refused request's own bytes
    mine, theirs = Hold(mib), Hold(mib)
    assert mine.take(20 << 20) and theirs.take(1 << 20)
    assert "(1 MiB held by others now)" in str(over_budget(mine, 300 << 20))
    assert not mine.resize(100 << 20)  # (1 + 100 > 100)
    assert "the other requests in flight hold 1 MiB of the 100 MiB budget (max_inflight_bytes) and this one needs " \
           "100 MiB" in str(over_budget(mine, 100 << 20))


def test_a_refused_prompt_refuses_the_batch_at_once() -> None:
    """One prompt of a batch refused (a full queue) cancels the others instead of scoring them
    first and throwing their results away (each retry would repeat that work)."""
    import asyncio

    from teacher_server.engine.async_engine import EngineOverloaded
    from teacher_server.server.batch_scoring import _all_scored

    async def main() -> None:
        async def refused() -> None:
            raise EngineOverloaded("queue full")

        slow = asyncio.ensure_future(asyncio.sleep(30))
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineOverloaded):
            await _all_scored([slow, asyncio.ensure_future(refused())])
        assert asyncio.get_running_loop().time() - t0 < 5
        await asyncio.sleep(0)
        assert slow.cancelled()

    asyncio.run(main())


def test_native_row_targets_count_in_the_byte_budget(server) -> None:
    """The native endpoint's teacher top-K (and union, actual, tail, log-sum-exp) arrays are
    part of the answer an admitted request holds: with bytes of another request held, a short
    body asking the top-64 of 199 rows (~400 KB of answer) is refused, while the same rows'
    one candidate each fits; alone both run."""
    budget: ByteBudget = server.app.state.byte_budget
    ids = list(range(1, 201))
    narrow = {"token_ids": ids, "sampling_params": {"prompt_logprob_start": 0, "prompt_logprob_token_ids": [7]}}
    wide = {"token_ids": ids, "sampling_params": {"prompt_logprob_start": 0, "prompt_logprob_token_ids": [7],
                                                  "prompt_logprob_topk": 64}}
    with server.client() as c:
        budget.take(1)
        try:
            assert_error(c.post("/inference/v1/generate", json=wide), 429, contains="max_inflight_bytes")
            assert c.post("/inference/v1/generate", json=narrow).status_code == 200
        finally:
            budget.give(1)
        assert c.post("/inference/v1/generate", json=wide).status_code == 200
        wait_until(lambda: budget.used == 0, 3, "the budget given back")
