"""The HTTP contract, served from a tiny gpt-oss (attention sinks, 8-token windows, biased
experts): the contract tests of ``test_api_contract`` run against a live server of it (the
demo model's vocabulary and limits), and a chunked sequence's scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import body, decode
from conftest import LiveServer
from oss_ref import make_gpt_oss_checkpoint
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
def oss_path(tmp_path_factory: pytest.TempPathFactory):
    return make_gpt_oss_checkpoint("plain", tmp_path_factory.mktemp("gpt_oss_api") / "tiny", vocab=4096)


@pytest.fixture(scope="module")
def oss_server(oss_path):
    cfg = Config(model=str(oss_path), device="cpu", max_num_batched_tokens=96, block_size=8, num_kv_blocks=2048,
                 max_model_len=8192, max_logprobs=64)
    with LiveServer(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(oss_server):
    with oss_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def good_result(client):
    from test_api_contract import GOOD

    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


def test_gpt_oss_scores_over_http_equal_transformers(client, oss_path) -> None:
    """A chunked sequence (longer than the 96-token budget and many windows) with per-row candidates."""
    rng = np.random.default_rng(6)
    toks = rng.integers(0, 4096, 230).tolist()
    cand = rng.integers(0, 4096, (229 - 100, 8))
    r = client.post(GEN, json=body(toks, cand.tolist(), start=100))
    assert r.status_code == 200, r.text
    got = decode(r.json()["prompt_token_id_logprobs"])
    np.testing.assert_allclose(got, reference_scores(oss_path, toks, cand, 100), atol=1e-4)
