"""The in-process API takes candidates as lists or numpy arrays (as the server takes the
binary form) and follows the client's rule for input that cannot be valid (K == 0, ragged
rows): a ValueError naming the field, before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

from teacher_server import LLM, SamplingParams, TokensPrompt
from teacher_server.client import candidates_array

VOCAB = 512
PARAM = "sampling_params.prompt_logprob_token_ids"


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["qwen3"]), device="cpu", max_model_len=256, num_kv_blocks=64, block_size=8)


def test_numpy_candidates_match_lists(llm: LLM) -> None:
    rng = np.random.default_rng(3)
    toks = rng.integers(0, VOCAB, 30).tolist()
    start = 11
    rows = len(toks) - 1 - start
    per_row = np.stack([rng.choice(VOCAB, 5, replace=False) for _ in range(rows)])
    per_row[4, -2:] = -1
    shared = rng.choice(VOCAB, 7, replace=False)
    want_rows, want_shared = llm.score(toks, per_row.tolist(), start), llm.score(toks, shared.tolist(), start)
    assert want_rows.shape == (rows, 5) and want_shared.shape == (rows, 7)
    for dtype in (np.int32, np.int64):
        got = llm.score(np.asarray(toks), per_row.astype(dtype), start)
        np.testing.assert_allclose(got, want_rows, rtol=0, atol=1e-5)
    for dtype in (np.int32, np.int64, np.uint16):  # no -1 in the shared form: unsigned ids work too
        np.testing.assert_allclose(llm.score(toks, shared.astype(dtype), start), want_shared, rtol=0, atol=1e-5)
    out = llm.generate(TokensPrompt(prompt_token_ids=toks),
                       SamplingParams(max_tokens=1, prompt_logprob_token_ids=per_row, prompt_logprob_start=start))
    np.testing.assert_allclose(out[0].prompt_token_id_logprobs, want_rows, rtol=0, atol=1e-5)
    assert np.isneginf(out[0].prompt_token_id_logprobs[4, -2:]).all()


@pytest.mark.parametrize("cands,start,match", [
    ([], 5, "K must be at least 1"),  # zero rows and K == 0: refused like any K == 0
    ([], 9, "K must be at least 1"),
    ([[]] * 4, 5, "K must be at least 1"),
    (np.zeros(0, np.int32), 9, "K must be at least 1"),
    (np.zeros((4, 0), np.int64), 5, "K must be at least 1"),
    (np.zeros((0, 0), np.int64), 9, "K must be at least 1"),
    ([[1, 2], 3, [4, 5], [6, 7]], 5, "a mix of ids and rows"),
    (np.array([1.0, 2.0]), 5, "integer"),
    (np.zeros((4, 2, 1), np.int32), 5, r"\[K\] or \[rows, K\]"),
])
def test_invalid_candidates_are_a_value_error(llm: LLM, cands, start: int, match: str) -> None:
    with pytest.raises(ValueError, match=match) as ei:
        llm.score(list(range(10)), cands, start)
    assert getattr(ei.value, "param", None) == PARAM


@pytest.mark.parametrize("toks", [np.array([3.9, 7.5, 11.2]), np.array([True, False, True]), np.array(["3", "7"])],
                         ids=["float", "bool", "str"])
def test_token_id_arrays_of_other_kinds_are_refused(llm: LLM, toks: np.ndarray) -> None:
    """An array of token ids is checked like a list: floats are not cut to integers, bools
    are not ids."""
    with pytest.raises(ValueError, match="integer ids") as ei:
        llm.generate(TokensPrompt(prompt_token_ids=toks), SamplingParams(max_tokens=1, prompt_logprob_token_ids=[1]))
    assert getattr(ei.value, "param", None) == "token_ids"
    out = llm.generate(TokensPrompt(prompt_token_ids=np.array([3, 7, 11], np.uint16)),
                       SamplingParams(max_tokens=1, prompt_logprob_token_ids=[1]))  # unsigned ids still work
    assert out[0].prompt_token_id_logprobs.shape == (2, 1)


def test_one_rule_for_client_and_llm(llm: LLM) -> None:
    """What the client refuses before sending, the LLM refuses with the same message."""
    for cands in ([], [[1, 2], [3]], np.zeros((2, 0), np.int32)):
        with pytest.raises(ValueError) as client_err:
            candidates_array(cands)
        with pytest.raises(ValueError) as llm_err:
            llm.score([1, 2, 3], cands, 1)
        assert str(llm_err.value) == str(client_err.value)
