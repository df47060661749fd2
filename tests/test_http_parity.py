"""End to end over HTTP: the decoded matrix equals the float32 transformers reference,
including sequences chunked across several steps (budget 96 tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import body, decode, npy_b64
from reference import reference_scores

GEN = "/inference/v1/generate"


@pytest.mark.parametrize("n,start,per_row,binary", [
    (300, 100, True, False), (300, 0, False, False), (257, 255, True, True), (64, 62, False, True),
    (500, 450, True, True), (2, 0, False, False),
])
def test_http_matches_reference(qwen3_server, checkpoints, n, start, per_row, binary) -> None:
    rng = np.random.default_rng(n + start)
    toks = rng.integers(0, 512, n)
    rows = max(n - 1 - start, 0)
    if per_row:
        cand = np.stack([rng.choice(512, 16, replace=False) for _ in range(rows)]).astype(np.int32)
        cand[:, -3:] = -1
    else:
        cand = rng.choice(512, 16, replace=False).astype(np.int32)
    payload = body(toks, npy_b64(cand) if binary else cand, start=start)
    with qwen3_server.client() as c:
        r = c.post(GEN, json=payload)
    assert r.status_code == 200, r.text
    got = decode(r.json()["prompt_token_id_logprobs"])
    ref = reference_scores(checkpoints["qwen3"], toks.tolist(), cand, start)
    assert got.shape == ref.shape
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    if fin.any():
        assert np.abs(got[fin] - ref[fin]).max() < 1e-4
