"""Vocab-parallel scoring: with tensor parallel each rank holds the LM head rows of one vocab
shard and makes that shard's float32 logits for a chunk of scored rows; the ranks then
exchange only per-row and per-candidate tensors, never the [rows, vocab] logits:

- candidates: per-row max m_r and sum-exp s_r and the shard's share of the candidates' logits
  (``gather_logprobs_partial``); M = max_r m_r (all-reduce MAX), then one all-reduce SUM of
  [s_r exp(m_r - M) | logits] ([rows, 1 + K]); log p = logit - (M + log sum).
- classic prompt_logprobs: the actual token's logit and its rank (counts summed), the
  row's log-sum-exp as above, and each rank's top-k with global ids, merged (all-gather
  [ranks, rows, k], top-k of those).
- greedy next token: each rank's max and its global id, all-gathered; the first rank with
  the largest value wins (its shard's ids are the lowest: the same tie rule as argmax).

Every rank runs the same calls in the same order (they are collectives); rank 0's outputs
are the step's results.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from teacher_server.layers.parallel import TensorParallel
from teacher_server.ops.gather_logprob import finish_partials, gather_logprobs_partial
from teacher_server.ops.top_k import top_k as shard_top_k


def _max_over_ranks(x: torch.Tensor, group: object) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _merged_stats(m: torch.Tensor, s: torch.Tensor, extra: torch.Tensor | None, group: object) -> tuple:
    """(M [R], sum_r s_r exp(m_r - M) [R], extra summed over ranks) with two collectives."""
    mx = _max_over_ranks(m.clone(), group)
    safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    scaled = (s * torch.exp(m - safe))[:, None]  # [R, 1]
    packed = scaled if extra is None else torch.cat([scaled, extra], dim=1)  # [R, 1 + K]
    dist.all_reduce(packed, group=group)
    return mx, packed[:, 0], None if extra is None else packed[:, 1:]


def candidate_logprobs(logits: torch.Tensor, cand: torch.Tensor, vocab_start: int,
                       logits_mode: bool, group: object = None) -> torch.Tensor:
    """logits: this rank's [r, Vr] float32; cand [r, K] global ids (-1 padding) -> [r, K]."""
    m, s, vals = gather_logprobs_partial(logits, cand, vocab_start, logits_mode)
    if logits_mode:
        dist.all_reduce(vals, group=group)
        return finish_partials(m, s, vals, cand, True)
    mx, se, vals = _merged_stats(m, s, vals, group)
    return finish_partials(mx, se, vals, cand)


def log_normalizer(sub: torch.Tensor, group: object = None) -> torch.Tensor:
    """log sum exp over the whole vocabulary of each row ([p, Vr] shard -> [p, 1])."""
    m = sub.amax(dim=-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    mx, se, _ = _merged_stats(m, torch.exp(sub - safe[:, None]).sum(-1), None, group)
    return (torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)) + torch.log(se))[:, None]


def actual_and_rank(sub: torch.Tensor, actual: torch.Tensor, vocab_start: int,
                    rank: bool = True, group: object = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The actual tokens' logits [p, 1] and their ranks [p] (the ids with a logit at least the
    token's, itself included: vLLM's rank, a tie ranking the token last of its ties; None
    without ``rank``: one pass over the shard and a collective fewer)."""
    local = actual - vocab_start
    inside = (local >= 0) & (local < sub.shape[1])
    act = sub.gather(1, local.clamp(0, sub.shape[1] - 1)[:, None]).masked_fill(~inside[:, None], 0.0)
    dist.all_reduce(act, group=group)
    if not rank:
        return act, None
    rank = (sub >= act).sum(-1)
    dist.all_reduce(rank, group=group)
    return act, rank


def top_k(sub: torch.Tensor, k: int, vocab_start: int, tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' top-k logits [p, k] and global ids [p, k] over all shards."""
    p = sub.shape[0]
    kl = min(k, sub.shape[1])
    v = torch.full((p, k), float("-inf"), dtype=sub.dtype, device=sub.device)
    i = torch.full((p, k), -1, dtype=torch.int64, device=sub.device)
    lv, li = shard_top_k(sub, kl)
    v[:, :kl], i[:, :kl] = lv, li + vocab_start
    vs, ids = [torch.empty_like(v) for _ in range(tp.size)], [torch.empty_like(i) for _ in range(tp.size)]
    dist.all_gather(vs, v, group=tp.group)
    dist.all_gather(ids, i, group=tp.group)
    allv, alli = torch.cat(vs, dim=1), torch.cat(ids, dim=1)  # [p, ranks * k], shards in id order
    best_v, at = allv.topk(k, dim=-1)
    return best_v, alli.gather(1, at)


def argmax(rows: torch.Tensor, vocab_start: int, tp: TensorParallel) -> torch.Tensor:
    """Greedy next token of each row ([a, Vr] shard) as a global id [a]."""
    v, i = rows.max(dim=-1)
    vs, ids = [torch.empty_like(v) for _ in range(tp.size)], [torch.empty_like(i) for _ in range(tp.size)]
    dist.all_gather(vs, v, group=tp.group)
    dist.all_gather(ids, i + vocab_start, group=tp.group)
    best = torch.stack(vs).argmax(dim=0)  # [a]: the first rank holding the max
    return torch.stack(ids).gather(0, best[None]).squeeze(0)
