"""The benchmark's transformers baseline computes the contract's matrix: run on CPU on a tiny
model in several left-padded batches, it matches the float32 reference request by request."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from reference import hf_model, reference_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import hf_baseline
from workloads import Req

VOCAB = 512  # the tiny checkpoints' vocabulary


def _requests(seed: int) -> list[Req]:
    """Mixed prompt and response lengths (left padding differs per row), unique ids per row,
    one -1 padded candidate."""
    rng = np.random.default_rng(seed)
    out = []
    for prompt, response in [(5, 9), (12, 3), (3, 20), (8, 8), (30, 1), (2, 14), (17, 11)]:
        toks = rng.integers(0, VOCAB, prompt + response)
        cand = np.stack([rng.choice(VOCAB, 6, replace=False) for _ in range(response)]).astype(np.int32)
        out.append(Req(toks, prompt - 1, cand))
    out[3].cand[2, -1] = -1
    return out


def test_batches_respect_the_budget() -> None:
    reqs = _requests(0)
    got = hf_baseline.batches(reqs, max_padded=64)
    assert sorted(i for b in got for i in b) == list(range(len(reqs)))
    lens = [[len(reqs[i].tokens) for i in b] for b in got]
    assert all(len(b) == 1 or len(b) * max(b) <= 64 for b in lens), lens
    assert [max(b) for b in lens] == sorted(max(b) for b in lens)  # length-sorted
    assert len(got) > 2


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3moe"])
def test_matches_the_float32_reference(checkpoints, family: str) -> None:
    path = checkpoints[family]
    reqs = _requests(1)
    seconds, results, finish = hf_baseline.run(hf_model(path), reqs, keep_results=True, max_padded=64)
    assert seconds > 0 and len(results) == len(finish) == len(reqs)
    assert all(0 < f <= seconds for f in finish)
    for r, got in zip(reqs, results):
        ref = reference_scores(path, r.tokens.tolist(), r.cand, r.start)
        assert got.shape == ref.shape == (r.rows, 6) and got.dtype == np.float32
        fin = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(got), fin)
        # batching with left padding changes the kernels' shapes, not the maths: float32 rounding
        np.testing.assert_allclose(got[fin], ref[fin], rtol=0, atol=1e-4)
    assert np.isneginf(results[3][2, -1])
    _, none, _ = hf_baseline.run(hf_model(path), reqs[:2], warmup=False)
    assert none == []
