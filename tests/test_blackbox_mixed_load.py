"""Black-box: one burst over the three scoring endpoints at once (the native one with every
row target, vLLM's /v1/completions, SGLang's /generate), valid requests beside invalid ones
and beside clients that hang up mid-body or right after sending. Each valid answer equals
the same request sent alone (float32 on CPU: within 1e-5, README), each invalid one is a 400,
and afterwards nothing is left counted in flight and the server serves as before."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
from apiutil import assert_error
from blackbox_util import assert_same, hang_ups
from conftest import wait_until

GEN, COMP, SGL = "/inference/v1/generate", "/v1/completions", "/generate"
VOCAB = 4096


def _valid(n: int) -> list[tuple[str, dict]]:
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, VOCAB, 40).tolist()  # a GRPO group's prompt: the prefix cache in play
    out = []
    for i in range(n):
        ids = (prompt if i % 2 else []) + rng.integers(0, VOCAB, int(rng.integers(1, 90))).tolist()
        start = int(rng.integers(0, len(ids)))
        rows = len(ids) - 1 - start
        kind = i % 4
        if kind == 0:
            cands = rng.integers(-1, VOCAB, (rows, 3)).tolist() if rows > 0 else [5, 6, 7]
            out.append((GEN, {"token_ids": ids, "sampling_params": {
                "prompt_logprob_start": start, "prompt_logprob_token_ids": cands, "prompt_logprob_topk": 4,
                "prompt_logprob_union": True, "prompt_logprob_tail": True, "prompt_logprob_actual": True,
                "prompt_logprob_logsumexp": True}}))
        elif kind == 1:
            out.append((GEN, {"token_ids": ids, "sampling_params": {"prompt_logprobs": 3, "max_tokens": 1}}))
        elif kind == 2:
            out.append((COMP, {"prompt": ids, "max_tokens": 1, "echo": True, "prompt_logprobs": 2}))
        else:
            out.append((SGL, {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                              "top_logprobs_num": 2, "token_ids_logprob": [1, 2, 2],
                              "sampling_params": {"max_new_tokens": 1}}))
    return out


INVALID = [
    (GEN, {"token_ids": [1, VOCAB], "sampling_params": {}}),
    (GEN, {"token_ids": [1, 2, 3], "sampling_params": {"prompt_logprob_token_ids": [[1]] * 3}}),
    (GEN, {"token_ids": [1, 2], "sampling_params": {"prompt_logprob_token_ids": []}}),
    (COMP, {"prompt": [], "max_tokens": 0}),
    (COMP, {"prompt": [1, 2], "max_tokens": 5}),
    (SGL, {"input_ids": [1, -4], "return_logprob": True}),
    (SGL, {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10_000}),
]


def test_a_mixed_burst_equals_each_request_alone(demo_server) -> None:
    valid = _valid(48)
    with demo_server.client() as c:
        alone = []
        for path, b in valid:
            r = c.post(path, json=b)
            assert r.status_code == 200, (path, r.text[:300])
            alone.append(r.json())

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as c:
            asked = [c.post(p, json=b) for p, b in valid + INVALID * 2]
            out = await asyncio.gather(*asked, *hang_ups(demo_server.port, valid[:12]))
            return out[:len(asked)]

    together = asyncio.run(burst())
    for (path, _), a, t in zip(valid, alone, together):
        assert t.status_code == 200, (path, t.text[:300])
        assert_same(a, t.json())
    for t in together[len(valid):]:
        assert_error(t, 400)

    with demo_server.client() as c:
        def idle() -> bool:  # requests, and the bytes they hold, all given back (the hung-up ones too)
            text = c.get("/metrics").text
            gauges = re.findall(r"^teacher_server_(?:num_requests_running|num_requests_waiting|inflight_bytes)"
                                r"\{[^}]*\} (\S+)$", text, re.M)
            return len(gauges) == 3 and all(float(v) == 0 for v in gauges)

        wait_until(idle, 60, "nothing in flight")
        assert c.get("/health").json() == {"status": "ready"}
        for (path, b), a in list(zip(valid, alone))[::6]:
            assert_same(a, c.post(path, json=b).json())
