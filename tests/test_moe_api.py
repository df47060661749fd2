"""The HTTP contract, served from a mixture-of-experts checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Qwen3-MoE (same vocabulary and
limits as the demo model they were written for), and its scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
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

MOE = "qwen3moe:4096"


@pytest.fixture(scope="module")
def client(checkpoints):
    yield from contract_client(checkpoints[MOE])


@pytest.fixture(scope="module")
def good_result(client):
    return good_scores(client)


def test_moe_scores_over_http_equal_transformers(client, checkpoints) -> None:
    """A chunked sequence (longer than the 96-token budget) with per-row candidates."""
    rng = np.random.default_rng(6)
    assert_scores_equal_transformers(client, checkpoints[MOE], rng.integers(0, VOCAB, 230).tolist(), rng)
