"""Helpers of the black-box HTTP tests: compare an answer with the same request's answer
alone, whatever the endpoint, and clients that hang up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine

import numpy as np
from apiutil import decode

TOL = 1e-5  # float32 on CPU, batched or alone (README)
ARRAYS = ("prompt_token_id_logprobs", "prompt_topk_token_ids", "prompt_topk_logprobs", "prompt_union_token_ids",
          "prompt_union_logprobs", "prompt_actual_logprobs", "prompt_tail_logprobs", "prompt_logsumexp")


def numbers(x: object) -> list[float]:
    """Every float of a JSON answer, in order (ids, names and times aside)."""
    if isinstance(x, dict):
        return [v for k in sorted(x) if k not in ("id", "created", "request_id", "e2e_latency", "cached_tokens")
                for v in numbers(x[k])]
    if isinstance(x, list):
        return [v for item in x for v in numbers(item)]
    return [x] if isinstance(x, float) else []


def ids_of(x: object) -> object:
    """The answer without its floats and per-call fields: every id, key and shape."""
    if isinstance(x, dict):
        return {k: ids_of(v) for k, v in x.items() if k not in ("id", "created", "request_id", "e2e_latency",
                                                              "cached_tokens", *ARRAYS)}
    if isinstance(x, list):
        return [ids_of(v) for v in x]
    return None if isinstance(x, float) else x


def assert_same(alone: dict, together: dict) -> None:
    """``together`` is ``alone`` up to ``TOL`` in every float, JSON or array, and equal in the rest."""
    assert ids_of(together) == ids_of(alone)
    np.testing.assert_allclose(numbers(together), numbers(alone), rtol=0, atol=TOL)
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


async def hang_up(port: int, raw: bytes) -> None:
    """A client that sends ``raw`` and closes without reading the answer."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def hang_ups(port: int, bodies: list[tuple[str, dict]]) -> list[Coroutine]:
    """Clients posting ``bodies`` (path, JSON) that close without reading: every other one
    mid-body."""
    out = []
    for i, (path, b) in enumerate(bodies):
        data = json.dumps(b).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        out.append(hang_up(port, head + (data if i % 2 else data[:len(data) // 2])))  # whole, or mid-body
    return out
