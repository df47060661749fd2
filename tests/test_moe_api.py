"""The HTTP contract, served from a mixture-of-experts checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Qwen3-MoE (same vocabulary and
limits as the demo model they were written for), and its scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import body, decode
from conftest import LiveServer
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

MOE = "qwen3moe:4096"


@pytest.fixture(scope="module")
def moe_server(checkpoints):
    cfg = Config(model=str(checkpoints[MOE]), device="cpu", max_num_batched_tokens=96, block_size=8,
                 num_kv_blocks=2048, max_model_len=8192, max_logprobs=64)
    with LiveServer(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(moe_server):
    with moe_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def good_result(client):
    from test_api_contract import GOOD

    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


def test_moe_scores_over_http_equal_transformers(client, checkpoints) -> None:
    """A chunked sequence (longer than the 96-token budget) with per-row candidates."""
    rng = np.random.default_rng(6)
    toks = rng.integers(0, 4096, 230).tolist()
    cand = rng.integers(0, 4096, (229 - 100, 8))
    r = client.post(GEN, json=body(toks, cand.tolist(), start=100))
    assert r.status_code == 200, r.text
    got = decode(r.json()["prompt_token_id_logprobs"])
    ref = reference_scores(checkpoints[MOE], toks, cand, 100)
    np.testing.assert_allclose(got, ref, atol=1e-4)
