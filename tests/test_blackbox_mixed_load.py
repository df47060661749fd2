"""Black-box: one burst over the three scoring endpoints at once (the native one with every
row target, vLLM's /v1/completions, SGLang's /generate), valid requests beside invalid ones
and beside clients that hang up mid-body or right after sending. Each valid answer equals
the same request sent alone (float32 on CPU: within 1e-5, README), each invalid one is a 400,
and afterwards nothing is left counted in flight and the server serves as before."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import numpy as np
from apiutil import assert_error, decode
from conftest import wait_until

GEN, COMP, SGL = "/inference/v1/generate", "/v1/completions", "/generate"
VOCAB, TOL = 4096, 1e-5
ARRAYS = ("prompt_token_id_logprobs", "prompt_topk_token_ids", "prompt_topk_logprobs", "prompt_union_token_ids",
          "prompt_union_logprobs", "prompt_actual_logprobs", "prompt_tail_logprobs", "prompt_logsumexp")


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


def _numbers(x: object) -> list[float]:
    """Every float of a JSON answer, in order (ids, names and times aside)."""
    if isinstance(x, dict):
        return [v for k in sorted(x) if k not in ("id", "created", "request_id", "e2e_latency", "cached_tokens")
                for v in _numbers(x[k])]
    if isinstance(x, list):
        return [v for item in x for v in _numbers(item)]
    return [x] if isinstance(x, float) else []


def _ids(x: object) -> object:
    """The answer without its floats and per-call fields: every id, key and shape."""
    if isinstance(x, dict):
        return {k: _ids(v) for k, v in x.items() if k not in ("id", "created", "request_id", "e2e_latency",
                                                              "cached_tokens", *ARRAYS)}
    if isinstance(x, list):
        return [_ids(v) for v in x]
    return None if isinstance(x, float) else x


def _assert_same(alone: dict, together: dict) -> None:
    assert _ids(together) == _ids(alone)
    np.testing.assert_allclose(_numbers(together), _numbers(alone), rtol=0, atol=TOL)
    for key in ARRAYS:
        if alone.get(key) is None:  # (absent, or null: prompt_token_id_logprobs without candidates)
            assert together.get(key) is None, key
            continue
        a, b = decode(alone[key]), decode(together[key])
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
            np.testing.assert_allclose(b[np.isfinite(b)], a[np.isfinite(a)], rtol=0, atol=TOL)
        else:
            np.testing.assert_array_equal(a, b)


async def _hang_up(port: int, raw: bytes) -> None:
    """A client that sends ``raw`` and closes without reading the answer."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def _hang_ups(port: int, bodies: list[tuple[str, dict]]) -> list:
    out = []
    for i, (path, b) in enumerate(bodies):
        data = json.dumps(b).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        out.append(_hang_up(port, head + (data if i % 2 else data[:len(data) // 2])))  # whole, or mid-body
    return out


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
            out = await asyncio.gather(*asked, *_hang_ups(demo_server.port, valid[:12]))
            return out[:len(asked)]

    together = asyncio.run(burst())
    for (path, _), a, t in zip(valid, alone, together):
        assert t.status_code == 200, (path, t.text[:300])
        _assert_same(a, t.json())
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
            _assert_same(a, c.post(path, json=b).json())
