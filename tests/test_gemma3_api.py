"""The HTTP contract, served from a Gemma 3 checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Gemma 3 (5 local layers with a
12-key window, then a global one; the demo model's vocabulary and limits), and a chunked
sequence far longer than the window scores as transformers does."""

from __future__ import annotations

import numpy as np
import pytest
from gemma_glm_ref import make_gemma3_checkpoint
from served_contract import VOCAB, assert_scores_equal_transformers, contract_client, good_scores
from test_api_contract import (
    test_candidate_forms_agree,
    test_duplicate_candidates_are_scored_like_any_column,
    test_other_endpoints,
    test_padding_scores_minus_inf,
    test_prompt_logprobs_layout,
    test_rejects,
    test_response_fields,
    test_zero_rows_is_empty_matrix,
)

__all__ = ["test_candidate_forms_agree", "test_duplicate_candidates_are_scored_like_any_column", "test_other_endpoints",
           "test_padding_scores_minus_inf", "test_prompt_logprobs_layout", "test_rejects", "test_response_fields",
           "test_zero_rows_is_empty_matrix"]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return make_gemma3_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3_api") / "m", vocab=4096)


@pytest.fixture(scope="module")
def client(gemma_path):
    yield from contract_client(gemma_path)


@pytest.fixture(scope="module")
def good_result(client):
    return good_scores(client)


def test_gemma3_scores_over_http_equal_transformers(client, gemma_path) -> None:
    """A sequence of 230 tokens (chunked at the 96-token budget, 19 windows long) with per-row
    candidates, then a second request sharing its first 150 tokens (its prompt's cached blocks hit)."""
    rng = np.random.default_rng(6)
    toks = rng.integers(0, VOCAB, 230).tolist()
    for seq in (toks, toks[:150] + rng.integers(0, VOCAB, 60).tolist()):
        r = assert_scores_equal_transformers(client, gemma_path, seq, rng)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96  # the prompt's full blocks
