"""64 concurrent requests of mixed lengths, K and modes each return exactly what the
same request returns alone: nothing leaks between requests batched together."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
from apiutil import body, decode, npy_b64

GEN = "/inference/v1/generate"


def make_bodies(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 600))
        toks = rng.integers(0, 4096, length)
        start = int(rng.integers(0, max(length, 1) + 2))
        rows = max(length - 1 - start, 0)
        k = int(rng.choice([1, 3, 16, 64]))
        mode = i % 5
        if mode == 0:
            b = body(toks, rng.choice(4096, k, replace=False), start=start)
        elif mode == 1:
            c = np.stack([rng.choice(4096, k, replace=False) for _ in range(rows)]) if rows else np.zeros((0, k), int)
            b = body(toks, c, start=start)
        elif mode == 2:
            c = np.stack([rng.choice(4096, k, replace=False) for _ in range(rows)]).astype(np.int32) if rows \
                else np.zeros((0, k), np.int32)
            b = body(toks, npy_b64(c), start=start, max_tokens=0)
        elif mode == 3:
            b = body(toks, rng.choice(4096, k, replace=False), start=start, prompt_logprobs=int(rng.integers(0, 5)))
        else:
            b = body(toks, prompt_logprobs=2, max_tokens=1)
        b["request_id"] = f"iso-{i}"
        b["cache_salt"] = f"salt-{i % 3}"
        out.append(b)
    return out


def strip(j: dict) -> dict:
    j = dict(j)
    j.pop("created")
    j["usage"] = dict(j["usage"], prompt_tokens_details=None)  # cache hits may differ; values may not
    return j


def close(a: dict, b: dict, tol: float) -> None:
    """Same response up to float rounding of `tol` (batching changes kernel shapes; a
    leak between requests would show up as errors of order 1, not 1e-6)."""
    a, b = strip(a), strip(b)
    ma, mb = decode(a.pop("prompt_token_id_logprobs") or npy_b64(np.zeros(0, np.float32))), \
        decode(b.pop("prompt_token_id_logprobs") or npy_b64(np.zeros(0, np.float32)))
    assert ma.shape == mb.shape
    np.testing.assert_array_equal(np.isfinite(ma), np.isfinite(mb))
    np.testing.assert_allclose(ma[np.isfinite(ma)], mb[np.isfinite(mb)], rtol=0, atol=tol)
    pa, pb = a.pop("prompt_logprobs"), b.pop("prompt_logprobs")
    assert (pa is None) == (pb is None)
    for ea, eb in zip(pa or [], pb or []):
        if ea is None:
            assert eb is None
            continue
        assert next(iter(ea)) == next(iter(eb))
        for k in set(ea) & set(eb):
            assert abs(ea[k]["logprob"] - eb[k]["logprob"]) <= tol
    assert a == b  # ids, usage, greedy token, request_id


def burst_then_alone(server, bodies: list[dict]) -> list[tuple[dict, dict]]:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            return await asyncio.gather(*(c.post(GEN, json=b) for b in bodies))

    together = asyncio.run(burst())
    with server.client() as c:
        alone = [c.post(GEN, json=b) for b in bodies]
    for t, a in zip(together, alone):
        assert t.status_code == 200 and a.status_code == 200, (t.text[:300], a.text[:300])
    return [(t.json(), a.json()) for t, a in zip(together, alone)]


def test_concurrent_equals_alone(demo_server) -> None:
    for t, a in burst_then_alone(demo_server, make_bodies(64)):
        close(t, a, tol=2e-5)


def test_concurrent_equals_alone_bitwise_in_deterministic_mode(tmp_path) -> None:
    from conftest import LiveServer

    from teacher_server.config import Config

    cfg = Config(demo_model_dir=str(tmp_path / "m"), device="cpu", deterministic=True,
                 max_num_batched_tokens=512, num_kv_blocks=2048, max_model_len=4096, max_logprobs=64)
    with LiveServer(cfg) as server:
        for t, a in burst_then_alone(server, make_bodies(64, seed=1)):
            assert strip(t) == strip(a), t["request_id"]
