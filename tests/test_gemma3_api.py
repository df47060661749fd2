"""The HTTP contract, served from a Gemma 3 checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Gemma 3 (5 local layers with a
12-key window, then a global one; the demo model's vocabulary and limits), and a chunked
sequence far longer than the window scores as transformers does."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import body, decode
from conftest import LiveServer
from gemma_glm_ref import make_gemma3_checkpoint
from reference import reference_scores
from test_api_contract import (
    GEN,
    test_candidate_forms_agree,
    test_duplicate_candidates_are_scored_like_any_column,
    test_other_endpoints,
    test_padding_scores_minus_inf,
    test_prompt_logprobs_layout,
    test_rejects,
    test_response_fields,
    test_zero_rows_is_empty_matrix,
)

from teacher_server.config import Config

__all__ = ["test_candidate_forms_agree", "test_duplicate_candidates_are_scored_like_any_column", "test_other_endpoints",
           "test_padding_scores_minus_inf", "test_prompt_logprobs_layout", "test_rejects", "test_response_fields",
           "test_zero_rows_is_empty_matrix"]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return make_gemma3_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3_api") / "m", vocab=4096)


@pytest.fixture(scope="module")
def client(gemma_path):
    cfg = Config(model=str(gemma_path), device="cpu", max_num_batched_tokens=96, block_size=8,
                 num_kv_blocks=2048, max_model_len=8192, max_logprobs=64)
    with LiveServer(cfg) as s, s.client() as c:
        yield c


@pytest.fixture(scope="module")
def good_result(client):
    from test_api_contract import GOOD

    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


def test_gemma3_scores_over_http_equal_transformers(client, gemma_path) -> None:
    """A sequence of 230 tokens (chunked at the 96-token budget, 19 windows long) with per-row
    candidates, then a second request sharing its first 150 tokens (its prompt's cached blocks hit)."""
    rng = np.random.default_rng(6)
    toks = rng.integers(0, 4096, 230).tolist()
    for seq in (toks, toks[:150] + rng.integers(0, 4096, 60).tolist()):
        cand = rng.integers(0, 4096, (len(seq) - 1 - 100, 8))
        r = client.post(GEN, json=body(seq, cand.tolist(), start=100))
        assert r.status_code == 200, r.text
        got = decode(r.json()["prompt_token_id_logprobs"])
        np.testing.assert_allclose(got, reference_scores(gemma_path, seq, cand, 100), atol=1e-4)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96  # the prompt's full blocks
