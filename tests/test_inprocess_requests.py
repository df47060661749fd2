"""The in-process API's requests (``build_request``, ``Engine``, ``AsyncEngine``), whose values
do not pass through the HTTP layer's JSON models: each is refused at submission where the
engine could not take it, never inside a step, where it had wedged the engine, hung callers or
left sequences and KV blocks held; and a request owns its arrays."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_async_engine import req, slow_engine

from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.validation import BadRequest, Limits, RowTargets, build_request

LIMITS = Limits(vocab_size=4000, max_model_len=256, max_logprobs=16, max_rows_x_k=10 ** 6)
TOKS = list(range(1, 41))


def build(**kw) -> ScoreRequest:
    return build_request(**{"token_ids": TOKS, "limits": LIMITS, "candidates": [5, 6, 7], "start": 20, **kw})


@pytest.mark.parametrize(("kw", "param"), [
    ({"cache_salt": b"tenant-7"}, "cache_salt"), ({"cache_salt": 7}, "cache_salt"),
    ({"request_id": 7}, "request_id"),
    ({"priority": None}, "priority"), ({"priority": "1"}, "priority"), ({"priority": 1.0}, "priority"),
    ({"start": 3.0}, "sampling_params.prompt_logprob_start"), ({"start": True}, "sampling_params.prompt_logprob_start"),
    ({"prompt_logprobs": 2.5}, "sampling_params.prompt_logprobs"), ({"max_tokens": 1.0}, "sampling_params.max_tokens"),
    ({"targets": RowTargets(topk=2.0)}, "sampling_params.prompt_logprob_topk"),
    ({"targets": RowTargets(temperature=10 ** 400)}, "sampling_params.prompt_logprob_temperature"),
    ({"token_ids": [1, 2, np.array(True), 4]}, "token_ids"),
])
def test_a_value_the_engine_cannot_take_is_refused_at_submission(kw: dict, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        build(**kw)
    assert e.value.param == param and len(e.value.message) < 200, e.value.message


def test_numpy_integers_are_read_as_ints() -> None:
    """An unsigned start had stayed np.uint64: on a prefix-cache hit its block count wrapped round
    (2**64 - ...), the sequence never fit and the engine waited on it for ever."""
    r = build(start=np.uint64(20), priority=np.int8(-3), prompt_logprobs=np.uint8(2), max_tokens=np.int64(0))
    assert (r.start, r.priority, r.prompt_logprobs, r.max_tokens) == (20, -3, 2, 0)
    assert all(type(v) is int for v in (r.start, r.priority, r.prompt_logprobs, r.max_tokens))


def test_a_request_owns_its_arrays() -> None:
    """A caller's array changed after submission changes nothing the engine scores (it had: the
    prefix cache kept the changed prompt's KV under the hash of the validated one)."""
    toks, cands = np.arange(1, 41, dtype=np.int64), np.array([[5, 6, 7]] * 19, dtype=np.int32)
    r = build(token_ids=toks, candidates=cands)
    toks[:] = 9
    cands[:] = 9
    assert r.token_ids.tolist() == TOKS and (r.candidates == [5, 6, 7]).all()
    assert not np.shares_memory(r.token_ids, toks) and not np.shares_memory(r.candidates, cands)


def test_an_engine_holds_nothing_of_a_request_it_cannot_queue(tmp_path) -> None:
    """A ScoreRequest built by hand whose priority does not order with the others: refused by
    add_request, and the engine keeps no sequence of it (it had kept one for its life, and
    failed valid requests queued beside it)."""
    eng = Engine(Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_num_batched_tokens=32,
                        num_kv_blocks=64, max_model_len=256))
    assert eng.add_request(req("queued", 30)) is None
    bad = req("bad", 30)
    bad.priority = None
    with pytest.raises(TypeError):
        eng.add_request(bad)
    assert eng.stats().active_requests == 1
    (res,) = eng.run_to_completion([req("after", 20)])  # (the queued one runs alongside)
    assert res.error is None
    stats = eng.stats()
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0


def test_the_same_request_object_twice_keeps_the_first_caller(tmp_path) -> None:
    """A ScoreRequest submitted again while queued is refused; the first caller is answered (it
    had waited for ever, and the queue had lost its place), and cancelling the refused second
    call does not cancel the first."""
    ae = AsyncEngine(slow_engine(tmp_path), 100, 10 ** 6)
    ae.start()

    async def main() -> None:
        r = req("x", 120)
        first = asyncio.ensure_future(ae.score(r))
        await asyncio.sleep(0.02)
        second = await asyncio.wait_for(ae.score(r), 30)
        assert second.error is not None and "already queued" in second.error
        again = asyncio.ensure_future(ae.score(r))
        await asyncio.sleep(0)
        again.cancel()
        res = await asyncio.wait_for(first, 60)
        assert res.error is None and res.token_id_logprobs.shape == (119, 2)
        await asyncio.sleep(0.1)
        assert ae.in_flight == 0

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
