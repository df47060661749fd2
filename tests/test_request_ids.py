"""Request ids belong to their callers: two clients may use the same ``request_id`` at
once (trainers that both count `rollout-0`, `rollout-1`, ...); each gets its own result,
with its id echoed."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
from apiutil import body, decode
from conftest import LiveServer

GEN = "/inference/v1/generate"


def test_same_request_id_in_flight_twice(demo_server: LiveServer) -> None:
    rng = np.random.default_rng(7)
    bodies = [{**body(rng.integers(0, 4096, n), [3, 5, 7], start=10), "request_id": "rollout-8"}
              for n in (700, 400)]  # long enough to be in flight together

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post(GEN, json=b) for b in bodies))

    rs = asyncio.run(both())
    with demo_server.client() as c:
        alone = [c.post(GEN, json={**b, "request_id": f"alone-{i}"}) for i, b in enumerate(bodies)]
    for r, a, b in zip(rs, alone, bodies):
        assert r.status_code == 200 and a.status_code == 200, (r.text[:300], a.text[:300])
        assert r.json()["request_id"] == "rollout-8"
        got = decode(r.json()["prompt_token_id_logprobs"])
        assert got.shape == (len(b["token_ids"]) - 11, 3)
        np.testing.assert_allclose(got, decode(a.json()["prompt_token_id_logprobs"]), atol=2e-5)
