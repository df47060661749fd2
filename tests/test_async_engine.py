"""AsyncEngine: cancellation by identity, request ids scoped to their caller, and no
request left hanging when the engine dies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from engine_util import fail_on_token

from teacher_server.config import Config
from teacher_server.engine.async_engine import AsyncEngine
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ErrorKind, ScoreRequest


def slow_engine(tmp_path, fatal_token: int | None = None) -> Engine:
    eng = Engine(Config(demo_model_dir=str(tmp_path / "m"), device="cpu", max_num_batched_tokens=32,
                        num_kv_blocks=512, max_model_len=4096))
    # long steps, so messages pile up in the inbox meanwhile
    fail_on_token(eng, -1 if fatal_token is None else fatal_token,
                  lambda: RuntimeError("CUDA error: an illegal memory access was encountered (injected)"), 0.05)
    return eng


def req(rid: str, n: int, first: int = 1) -> ScoreRequest:
    toks = np.arange(first, first + n) % 4000
    return ScoreRequest(rid, toks, 0, np.array([1, 2]))


def test_cancelling_a_duplicate_id_does_not_cancel_the_original(tmp_path) -> None:
    ae = AsyncEngine(slow_engine(tmp_path), 100, 10 ** 6)
    ae.start()

    async def main() -> None:
        a = asyncio.ensure_future(ae.score(req("x", 200)))
        await asyncio.sleep(0.02)
        b = asyncio.ensure_future(ae.score(req("x", 10)))
        await asyncio.sleep(0.01)
        b.cancel()
        res = await a
        assert res.error is None and res.token_id_logprobs.shape == (199, 2)

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_same_request_id_from_two_callers(tmp_path: Path) -> None:
    """Two callers in flight at once with the same request_id (two trainers both counting
    `rollout-0`, ...): both succeed, each with its own result and its id echoed."""
    eng = slow_engine(tmp_path)
    a, b = req("rollout-0", 120, first=1), req("rollout-0", 90, first=500)
    alone = eng.run_to_completion([req("a", 120, first=1), req("b", 90, first=500)])
    ae = AsyncEngine(eng, 100, 10 ** 6)
    ae.start()

    async def main() -> None:
        ra, rb = await asyncio.wait_for(asyncio.gather(ae.score(a), ae.score(b)), 60)
        for got, want in ((ra, alone[0]), (rb, alone[1])):
            assert got.error is None and got.request_id == "rollout-0"
            np.testing.assert_allclose(got.token_id_logprobs, want.token_id_logprobs, atol=1e-5)
        assert ra.token_id_logprobs.shape == (119, 2) and rb.token_id_logprobs.shape == (89, 2)

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_fatal_error_answers_queued_requests(tmp_path) -> None:
    fired = []
    ae = AsyncEngine(slow_engine(tmp_path, fatal_token=3999), 100, 10 ** 6, on_fatal=fired.append)
    alive_at_answer = {}
    deliver = ae._deliver

    def recording(res):  # the engine's state as each answer goes out (a replica reads it then)
        alive_at_answer[res.request_id] = ae.alive
        deliver(res)

    ae._deliver = recording
    ae.start()

    async def main() -> None:
        a = asyncio.ensure_future(ae.score(req("a", 10, first=3991)))  # contains the fatal token
        await asyncio.sleep(0.01)
        others = [asyncio.ensure_future(ae.score(req(f"b{i}", 10))) for i in range(5)]
        results = await asyncio.wait_for(asyncio.gather(a, *others, return_exceptions=True), 10)
        for r in results:
            assert isinstance(r, Exception) or r.error is not None, r
        # the failing step's own request: INTERNAL (500); the others were never scored and are
        # not at fault: UNAVAILABLE (a 503 with Retry-After, so a client goes to another server)
        assert results[0].error_kind == ErrorKind.INTERNAL
        assert alive_at_answer["a"] is False  # dead before its answer: a replica hands it back
        queued = [r for r in results[1:] if not isinstance(r, Exception) and r.error_kind != ErrorKind.INTERNAL]
        assert queued and all(r.error_kind == ErrorKind.UNAVAILABLE for r in queued)
        assert ae.in_flight == 0 and not ae.alive
        for _ in range(200):  # on_fatal runs in the engine thread right after the answers
            if fired:
                break
            await asyncio.sleep(0.01)
        assert fired

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_build_makes_the_engine_in_its_own_thread(tmp_path) -> None:
    """``AsyncEngine.build`` runs the factory in the engine thread, the thread that then runs
    every step (per-thread GPU state from start-up, such as cuDNN plans, is reused)."""
    import threading

    seen: dict[str, int] = {}

    def factory():
        seen["built"] = threading.get_ident()
        eng = slow_engine(tmp_path)
        step = eng.step

        def tracked_step(**kw):
            seen["step"] = threading.get_ident()
            return step(**kw)

        eng.step = tracked_step
        return eng

    async def main() -> None:
        ae = await AsyncEngine.build(factory, 100, 10 ** 6)
        try:
            res = await asyncio.wait_for(ae.score(req("a", 10)), 30)
            assert res.error is None
        finally:
            ae.shutdown()
        assert seen["built"] == seen["step"] != threading.get_ident()

    asyncio.run(main())


def test_build_raises_what_the_factory_raised() -> None:
    def factory():
        raise ValueError("no such model")

    async def main() -> None:
        with pytest.raises(ValueError, match="no such model"):
            await AsyncEngine.build(factory, 100, 10 ** 6)

    asyncio.run(main())
