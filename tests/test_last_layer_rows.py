"""After the last layer's mixer the model computes only the rows that reach the LM head (its
o projection, MLP and norms): the scores are those of computing every row, steps with no
such row skip that work, and the mixer still writes every row's keys and states."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from engine_util import around_forward
from reference import make_checkpoint, make_hybrid_checkpoint, make_moe_checkpoint

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

MAKERS = {"qwen3": make_checkpoint, "qwen3moe": make_moe_checkpoint, "qwen3_5": make_hybrid_checkpoint}


def requests(seed: int) -> list[ScoreRequest]:
    """At a 32-token budget: a long prompt with few scored rows (steps where nothing reaches the
    head), a fully scored one, classic prompt logprobs, and one scored only by its greedy token."""
    rng = np.random.default_rng(seed)
    out = []
    for j, (n, start, plp, max_tokens) in enumerate([(100, 90, None, 1), (40, 0, None, 0), (70, 69, None, 1),
                                                     (50, 10, 3, 0), (45, 60, None, 1)]):
        toks = rng.integers(0, 512, n)
        rows = max(n - 1 - start, 0)
        cand = rng.integers(0, 512, (rows, 4))
        out.append(ScoreRequest(f"r{j}", toks, start, cand, prompt_logprobs=plp, max_tokens=max_tokens))
    return out


@pytest.mark.parametrize("family", list(MAKERS))
def test_last_layer_runs_only_the_rows_the_head_reads(family: str, tmp_path) -> None:
    path = MAKERS[family](family, tmp_path / family)
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8, num_kv_blocks=256,
                 max_model_len=512, enable_prefix_caching=False)
    results, seen = {}, {}
    for rows_only in (True, False):
        eng = Engine(cfg)
        eng.tuning = replace(eng.tuning, last_layer_rows_only=rows_only)
        steps: list[list[int]] = []  # per step: [tokens, rows reaching the head, rows through the last MLP]
        around_forward(eng, before=lambda ctx, s=steps: s.append([ctx.input_ids.numel(), ctx.logits_idx.numel()]))
        eng.model.layers[-1].mlp.register_forward_pre_hook(lambda m, args, s=steps: s[-1].append(args[0].shape[0]))
        results[rows_only] = eng.run_to_completion(requests(1))
        seen[rows_only] = steps
    on, off = seen[True], seen[False]
    assert any(s[1] == 0 for s in on), "the requests must make a step where no row reaches the head"
    for tokens, head_rows, *mlp_rows in on:  # the MLP saw the head's rows, and nothing when there were none
        assert mlp_rows == ([head_rows] if head_rows else []), (tokens, head_rows, mlp_rows)
    assert [s[:2] for s in off] == [s[:2] for s in on]
    for tokens, _, *mlp_rows in off:
        assert mlp_rows == [tokens]
    for a, b in zip(results[True], results[False]):
        assert a.error is None and b.error is None, (a.error, b.error)
        np.testing.assert_allclose(a.token_id_logprobs, b.token_id_logprobs, rtol=0, atol=2e-5)
        assert a.next_token == b.next_token
        if a.plp_token_logprob is not None:
            np.testing.assert_allclose(a.plp_token_logprob, b.plp_token_logprob, rtol=0, atol=2e-5)
            np.testing.assert_array_equal(a.plp_topk_ids, b.plp_topk_ids)
