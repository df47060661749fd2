"""The HTTP contract, served from a Gemma 3 checkpoint: the contract tests of
``test_api_contract`` run against a live server of a tiny Gemma 3 (5 local layers with a
12-key window, then a global one; the demo model's vocabulary and limits), and a chunked
sequence far longer than the window scores as transformers does."""

from __future__ import annotations

import numpy as np
import pytest
from gemma_glm_ref import make_gemma3_checkpoint
from served_contract import *  # noqa: F403  (test_api_contract's tests, the client and good_result fixtures)
from served_contract import VOCAB, assert_scores_equal_transformers


@pytest.fixture(scope="module")
def served_path(tmp_path_factory):
    return make_gemma3_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3_api") / "m", vocab=4096)


def test_gemma3_scores_over_http_equal_transformers(client, served_path) -> None:
    """A sequence of 230 tokens (chunked at the 96-token budget, 19 windows long) with per-row
    candidates, then a second request sharing its first 150 tokens (its prompt's cached blocks hit)."""
    rng = np.random.default_rng(6)
    toks = rng.integers(0, VOCAB, 230).tolist()
    for seq in (toks, toks[:150] + rng.integers(0, VOCAB, 60).tolist()):
        r = assert_scores_equal_transformers(client, served_path, seq, rng)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96  # the prompt's full blocks
