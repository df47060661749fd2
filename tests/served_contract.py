"""What the families' served-contract modules share (``test_moe_api``, ``test_gemma3_api``,
``test_gpt_oss_api``): each re-runs ``test_api_contract``'s tests against a live server of its
own tiny checkpoint (the demo model's vocabulary and limits). A module takes them, with the
``client`` and ``good_result`` fixtures they ask for, by ``from served_contract import *`` and
names its checkpoint in a ``served_path`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from apiutil import body, decode
from conftest import LiveServer
from reference import reference_scores
from test_api_contract import (
    GEN,
    GOOD,
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

# what a star import takes: the contract tests, and the fixtures they ask for
__all__ = ["client", "good_result", "test_candidate_forms_agree", "test_duplicate_candidates_are_scored_like_any_column",
           "test_other_endpoints", "test_padding_scores_minus_inf", "test_prompt_logprobs_layout", "test_rejects",
           "test_response_fields", "test_zero_rows_is_empty_matrix"]

VOCAB = 4096  # the demo model's, which the contract tests' requests are written for


@pytest.fixture(scope="module")
def client(served_path: Path) -> Iterator[httpx.Client]:
    """A client of a live server of the module's checkpoint (``contract_client``)."""
    yield from contract_client(served_path)


@pytest.fixture(scope="module")
def good_result(client: httpx.Client) -> np.ndarray:
    return good_scores(client)


def contract_client(path: Path) -> Iterator[httpx.Client]:
    """A client of a live server of ``path`` at the contract tests' limits (a 96-token step
    budget: their long sequences are chunked)."""
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=96, block_size=8, num_kv_blocks=2048,
                 max_model_len=8192, max_logprobs=64)
    with LiveServer(cfg) as s, s.client() as c:
        yield c


def good_scores(client: httpx.Client) -> np.ndarray:
    """The scores of the contract tests' good request (their ``good_result`` fixture)."""
    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


def assert_scores_equal_transformers(client: httpx.Client, path: Path, seq: list[int], rng: np.random.Generator,
                                     start: int = 100) -> httpx.Response:
    """One request of ``seq`` with 8 per-row candidates from ``start``: its scores within 1e-4 of
    transformers float32 on the same checkpoint. Returns the response."""
    cand = rng.integers(0, VOCAB, (len(seq) - 1 - start, 8))
    r = client.post(GEN, json=body(seq, cand.tolist(), start=start))
    assert r.status_code == 200, r.text
    got = decode(r.json()["prompt_token_id_logprobs"])
    np.testing.assert_allclose(got, reference_scores(path, seq, cand, start), atol=1e-4)
    return r
