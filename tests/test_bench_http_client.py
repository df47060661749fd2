"""The benchmark's HTTP clients: the raw one (asyncio streams, a fresh connection per request)
gets the same answers as httpx from a live server, and both time a run."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_engine
from workloads import Req


def _reqs(n: int) -> list[Req]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        tokens = rng.integers(0, 200, 40 + 7 * i).astype(np.int64)
        start = 10 + i
        rows = len(tokens) - 1 - start
        cand = np.stack([rng.permutation(200)[:8] for _ in range(rows)]).astype(np.int32)
        out.append(Req(tokens, start, cand))
    return out


def test_raw_client_matches_httpx(demo_server) -> None:
    reqs = _reqs(3)
    for r in reqs:
        body = bench_engine.http_body(r)
        status, data = asyncio.run(bench_engine.raw_post(demo_server.url, "/inference/v1/generate", body))
        ref = httpx.post(demo_server.url + "/inference/v1/generate", content=body, timeout=60,
                         headers={"content-type": "application/json"})
        assert status == ref.status_code == 200
        got, want = (np.load(io.BytesIO(base64.b64decode(json.loads(d)["prompt_token_id_logprobs"])))
                     for d in (data, ref.content))
        assert got.shape == r.cand.shape and np.array_equal(got, want)
    # an error answer comes back whole too (status and the documented error body)
    status, data = asyncio.run(bench_engine.raw_post(demo_server.url, "/inference/v1/generate", b"{"))
    assert status == 400 and "error" in json.loads(data)
    for client in ("raw", "httpx"):
        run = asyncio.run(bench_engine.http_run(demo_server.url, reqs, 2, client))
        dt, lat = run.seconds, run.latencies
        assert dt > 0 and all(x > 0 for x in lat)
        # each request's headers, then its whole body, left the client inside the pass (the head's client side)
        assert all(run.start <= s["headers"] <= s["body"] <= run.start + dt for s in run.sent), (client, run.sent)
        sending = run.sending()
        assert 0 <= sending["first_headers_sent_s"] <= sending["first_body_sent_s"] <= sending["last_body_sent_s"] <= dt


def test_http_client_list() -> None:
    """--http-client: one client or several (alternated in each repeat), each named once."""
    assert bench_engine._clients("raw") == ["raw"]
    assert bench_engine._clients("raw,httpx") == ["raw", "httpx"]
    for bad in ("", "curl", "raw,raw", "raw,"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_engine._clients(bad)


def test_client_gc_frozen_during_a_pass_and_its_pauses_counted() -> None:
    """Inside a pass the process's heap is frozen (a full collection walks only what the pass
    made) and each collection's pause is added up; after it nothing stays frozen and the
    callback is gone."""
    import gc

    frozen_before = gc.get_freeze_count()
    keep = [[i] for i in range(20_000)]  # long-lived objects made before the pass
    with bench_engine.FrozenHeap() as pauses:
        assert gc.get_freeze_count() >= len(keep)
        gc.collect()
        gc.collect()
    assert pauses.seconds > 0
    if frozen_before == 0:  # (a server started in this process earlier keeps its frozen heap frozen)
        assert gc.get_freeze_count() == 0
    assert pauses._note not in gc.callbacks
    seconds = pauses.seconds
    gc.collect()  # outside the pass: not counted
    assert pauses.seconds == seconds
    del keep
