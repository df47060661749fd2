"""The HTTP contract, served from a mixture-of-experts checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Qwen3-MoE (same vocabulary and
limits as the demo model they were written for), and its scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from served_contract import *  # noqa: F403  (test_api_contract's tests, the client and good_result fixtures)
from served_contract import VOCAB, assert_scores_equal_transformers

MOE = "qwen3moe:4096"


@pytest.fixture(scope="module")
def served_path(checkpoints):
    return checkpoints[MOE]


def test_moe_scores_over_http_equal_transformers(client, served_path) -> None:
    """A chunked sequence (longer than the 96-token budget) with per-row candidates."""
    rng = np.random.default_rng(6)
    assert_scores_equal_transformers(client, served_path, rng.integers(0, VOCAB, 230).tolist(), rng)
