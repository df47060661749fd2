"""One timed pass of a workload through the HTTP endpoint: every request sent through the
async client (binary per-row candidates, as trainers send them) with at most ``concurrency``
in flight, the clock from the first send to the last answer."""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass

import numpy as np

from teacher_server.benchmark.progress_bar import ProgressBar
from teacher_server.benchmark.workloads import Req
from teacher_server.client import AsyncTeacherClient


@dataclass
class Pass:
    seconds: float
    latencies_s: list[float]  # per request, in input order
    cached_tokens: list[int]  # prefix-cache hits the server reported, per request


async def _run(url: str, reqs: list[Req], concurrency: int, api_key: str | None, bar: ProgressBar) -> Pass:
    lat, cached = [0.0] * len(reqs), [0] * len(reqs)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncTeacherClient(url, api_key=api_key, max_concurrency=concurrency, timeout=3600.0) as client:
        async def one(i: int, r: Req) -> None:
            async with gate:
                t = time.perf_counter()
                out = await client.score_full(r.tokens, r.cand, r.start)
                lat[i], cached[i] = time.perf_counter() - t, out.cached_tokens
                assert out.scores.shape == r.cand.shape, f"request {i}: {out.scores.shape} != {r.cand.shape}"
                bar.update()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        seconds = time.perf_counter() - t0
    return Pass(seconds, lat, cached)


def run_pass(url: str, reqs: list[Req], concurrency: int, api_key: str | None, label: str) -> Pass:
    bar = ProgressBar(label, len(reqs))
    try:
        return asyncio.run(_run(url, reqs, concurrency, api_key, bar))
    finally:
        bar.close()


def warm_up(url: str, vocab: int, api_key: str | None) -> None:
    """One small request first, so connection set-up and the server's first-request work are
    not in the timed pass."""
    rng = np.random.default_rng(1)
    req = Req(rng.integers(0, vocab, 64), 31, rng.integers(0, vocab, (32, 4)).astype(np.int32))
    asyncio.run(_run(url, [req], 1, api_key, ProgressBar("warm-up", 1, stream=io.StringIO())))
