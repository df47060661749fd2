"""The actual token's rank in ``prompt_logprobs`` is vLLM's: the number of ids whose value is at
least the token's (vllm/v1/sample/ops/logprobs.py ``batched_count_greater_than`` counts
``x >= value``), so a token tied with others ranks last of its ties; on one GPU and over
vocabulary shards alike."""

from __future__ import annotations

import torch

from teacher_server.engine import vocab_parallel as vp
from teacher_server.engine.scoring import _WholeVocab

# [2, 6] rows with ties: row 0's id 2 ties id 1 for the top; row 1's id 5 ties ids 0 and 3 below id 4
SUB = torch.tensor([[1.0, 3.0, 3.0, 2.0, -1.0, 0.5],
                    [0.0, -2.0, -1.0, 0.0, 4.0, 0.0]])
ACTUAL = torch.tensor([2, 5])
VLLM_RANKS = [2, 4]


def test_whole_vocabulary_rank_counts_ties() -> None:
    act, rank = _WholeVocab().actual_and_rank(SUB, ACTUAL)
    assert act[:, 0].tolist() == [3.0, 0.0]
    assert rank.tolist() == VLLM_RANKS
    assert _WholeVocab().actual_and_rank(SUB, torch.tensor([1, 4]))[1].tolist() == [2, 1]  # (no tie below: 1)


def test_vocabulary_shards_rank_counts_ties(monkeypatch) -> None:
    """Two shards of three ids each: each counts its own ids at or above the token's value (the
    value every rank gets from the all-reduce), and the ranks' sum is the rank."""
    value = SUB.gather(1, ACTUAL[:, None])  # what the value's all-reduce gives every rank

    def all_reduce(t: torch.Tensor, group: object = None) -> None:
        if t.dtype.is_floating_point:
            t.copy_(value)  # (the counts are summed below, by hand)

    monkeypatch.setattr(vp.dist, "all_reduce", all_reduce)
    ranks = sum(vp.actual_and_rank(SUB[:, s:s + 3], ACTUAL, s)[1] for s in (0, 3))
    assert ranks.tolist() == VLLM_RANKS


def test_actual_token_among_the_top_k_takes_its_top_k_entry() -> None:
    """vLLM's entry is a dict by id written actual first, then the top-k: the actual token's key
    stays first and holds the top-k's rank (vllm/logprobs.py ``append_logprobs_for_next_position``),
    which differs from the counted rank when it ties (here: counted 3, listed second)."""
    import numpy as np

    from teacher_server.engine.request import ScoreRequest, ScoreResult, prompt_logprob_entries

    req = ScoreRequest("r", np.array([4, 7, 9]), prompt_logprobs=2)
    res = ScoreResult.empty_for(req)
    res.plp_token_logprob[:] = [-0.5, -3.0]
    res.plp_token_rank[:] = [3, 9]
    res.plp_topk_ids[:] = [[2, 7], [1, 3]]
    res.plp_topk_logprobs[:] = [[-0.5, -0.5], [-0.25, -1.5]]
    assert prompt_logprob_entries(req.token_ids, res) == [
        None, [(7, -0.5, 2), (2, -0.5, 1)], [(9, -3.0, 9), (1, -0.25, 1), (3, -1.5, 2)]]
