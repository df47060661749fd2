"""The HTTP contract, served from a tiny gpt-oss (attention sinks, 8-token windows, biased
experts): the contract tests of ``test_api_contract`` run against a live server of it (the
demo model's vocabulary and limits), and a chunked sequence's scores equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from oss_ref import make_gpt_oss_checkpoint
from served_contract import *  # noqa: F403  (test_api_contract's tests, the client and good_result fixtures)
from served_contract import VOCAB, assert_scores_equal_transformers


@pytest.fixture(scope="module")
def served_path(tmp_path_factory: pytest.TempPathFactory):
    return make_gpt_oss_checkpoint("plain", tmp_path_factory.mktemp("gpt_oss_api") / "tiny", vocab=4096)


def test_gpt_oss_scores_over_http_equal_transformers(client, served_path) -> None:
    """A chunked sequence (longer than the 96-token budget and many windows) with per-row candidates."""
    rng = np.random.default_rng(6)
    assert_scores_equal_transformers(client, served_path, rng.integers(0, VOCAB, 230).tolist(), rng)
