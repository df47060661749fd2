"""Shared candidates scored at the last position too (``ScoreRequest.next_candidates``: the next
token's distribution, SGLang's ``output_token_ids_logprobs`` of a generated token): one row more
in ``token_id_logprobs``, equal to the float32 transformers reference, with the scored rows
before it unchanged, whether the last position is in the first chunk or a later one."""

from __future__ import annotations

import numpy as np
import pytest
from reference import reference_logprobs

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

VOCAB = 512
TOL = 1e-4


@pytest.mark.parametrize(("length", "start"), [(9, 8), (9, 3), (40, 39), (40, 21), (1, 0)])
def test_next_candidates_score_the_last_position(checkpoints, length: int, start: int) -> None:
    path = checkpoints["qwen3"]
    eng = Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=16, num_kv_blocks=64, block_size=8,
                        max_model_len=128))
    rng = np.random.default_rng(length + start)
    toks = rng.integers(0, VOCAB, length)
    cand = rng.choice(VOCAB, 5, replace=False)
    req = ScoreRequest("n", toks, start, cand, max_tokens=1, next_candidates=True)
    plain = ScoreRequest("p", toks, start, cand, max_tokens=1)
    res, base = eng.run_to_completion([req, plain])
    ref = reference_logprobs(path, toks.tolist())  # [L, V]: row p predicts token p + 1
    rows = length - 1 - start
    assert res.token_id_logprobs.shape == (rows + 1, 5)
    np.testing.assert_allclose(res.token_id_logprobs[-1], ref[length - 1, cand], atol=TOL)
    np.testing.assert_allclose(res.token_id_logprobs[:rows], base.token_id_logprobs, atol=1e-6)
    assert res.next_token == base.next_token == int(ref[length - 1].argmax())
