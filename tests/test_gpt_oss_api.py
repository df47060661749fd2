"""The HTTP contract, served from a tiny gpt-oss (attention sinks, 8-token windows, biased
experts): the contract tests of ``test_api_contract`` run against a live server of it (the
demo model's vocabulary and limits), and a chunked sequence's scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from oss_ref import make_gpt_oss_checkpoint
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
def oss_path(tmp_path_factory: pytest.TempPathFactory):
    return make_gpt_oss_checkpoint("plain", tmp_path_factory.mktemp("gpt_oss_api") / "tiny", vocab=4096)


@pytest.fixture(scope="module")
def client(oss_path):
    yield from contract_client(oss_path)


@pytest.fixture(scope="module")
def good_result(client):
    return good_scores(client)


def test_gpt_oss_scores_over_http_equal_transformers(client, oss_path) -> None:
    """A chunked sequence (longer than the 96-token budget and many windows) with per-row candidates."""
    rng = np.random.default_rng(6)
    assert_scores_equal_transformers(client, oss_path, rng.integers(0, VOCAB, 230).tolist(), rng)
