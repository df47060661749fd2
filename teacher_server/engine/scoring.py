"""The scoring stage: hidden states of scored rows -> float32 logits in row chunks (the
head layer's ``logits``) -> gather-logprob kernel. The full [rows, vocab] matrix never exists beyond one chunk.

Classic ``prompt_logprobs`` (top-k + the actual token, with ranks) and the greedy next
token reuse the same logits chunks, and so do the row targets (the teacher's top-K, the
actual token's log-prob, the log normalizer, the log of the mass outside the candidates and
the top-K), which are the classic reductions over the scored rows plus one masked
log-sum-exp; a per-row temperature divides a chunk's logits before all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from teacher_server.engine import vocab_parallel as vp
from teacher_server.layers.embedding import VocabRows
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.ops.gather_logprob import gather_logprobs, gather_logprobs_partial, mask_ids_
from teacher_server.ops.top_k import top_k


@dataclass
class ScoringPlan:
    """What to compute for the R logit rows of one step (device tensors)."""

    cand: torch.Tensor  # [R, Kmax] int64, -1 = no candidate
    kmax: int
    plp_rows: torch.Tensor | None  # [Rp] int64 ascending rows (into R) needing classic prompt_logprobs
    plp_actual: torch.Tensor | None  # [Rp] int64 actual next token ids
    plp_k: int  # top-k width for those rows (max over requests)
    argmax_rows: torch.Tensor | None  # [Ra] int64 ascending rows needing the greedy next token
    # Host copies of the row lists: chunk boundaries are found on the host (no device sync).
    plp_rows_host: np.ndarray | None = None
    argmax_rows_host: np.ndarray | None = None
    tail_k: torch.Tensor | None = None  # [Rp] int64 top-k columns in each plp row's tail set, -1: none
    row_temp: torch.Tensor | None = None  # [R] float32 temperature of each row (None: all 1)
    want_lse: bool = False  # the log normalizer is asked for itself (else only made to normalise)
    want_rank: bool = True  # a request reads the actual token's rank (classic prompt_logprobs)


@dataclass
class ScoringOutput:
    scores: torch.Tensor | None  # [R, Kmax] float32
    plp_actual: torch.Tensor | None  # [Rp] float32
    plp_rank: torch.Tensor | None  # [Rp] int64
    plp_topk_vals: torch.Tensor | None  # [Rp, plp_k] float32
    plp_topk_ids: torch.Tensor | None  # [Rp, plp_k] int64
    argmax: torch.Tensor | None  # [Ra] int64
    plp_lse: torch.Tensor | None = None  # [Rp] float32 log normalizer of the plp rows
    plp_tail: torch.Tensor | None = None  # [Rp] float32 log of the mass outside each row's set


def _empty_output(r: int, plan: ScoringPlan, dev: torch.device) -> ScoringOutput:
    """The step's output buffers (None where the plan asks for nothing), filled chunk by chunk."""
    n_p = 0 if plan.plp_rows is None else plan.plp_rows.numel()
    n_a = 0 if plan.argmax_rows is None else plan.argmax_rows.numel()
    f32, i64 = torch.float32, torch.int64
    return ScoringOutput(
        torch.empty(r, plan.kmax, dtype=f32, device=dev) if plan.kmax else None,  # [R, K]
        torch.empty(n_p, dtype=f32, device=dev) if n_p else None,  # actual token's logprob [Rp]
        torch.empty(n_p, dtype=i64, device=dev) if n_p else None,  # its rank [Rp]
        torch.empty(n_p, plan.plp_k, dtype=f32, device=dev) if n_p else None,  # top-k values [Rp, k]
        torch.empty(n_p, plan.plp_k, dtype=i64, device=dev) if n_p else None,  # top-k ids [Rp, k]
        torch.empty(n_a, dtype=i64, device=dev) if n_a else None,  # greedy next token [Ra]
        torch.zeros(n_p, dtype=f32, device=dev) if n_p else None,  # log normalizer [Rp]
        torch.empty(n_p, dtype=f32, device=dev) if n_p and plan.tail_k is not None else None)  # tail [Rp]


class _WholeVocab:
    """The per-chunk reductions over logits that hold the whole vocabulary (one rank)."""

    def candidates(self, logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool) -> torch.Tensor:
        return gather_logprobs(logits, cand, logits_mode=logits_mode)

    def actual_and_rank(self, sub: torch.Tensor, actual: torch.Tensor,
                        rank: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        act = sub.gather(1, actual[:, None])  # [p, 1]
        # vLLM's rank: the ids at or above the token's value, so a tie ranks the token last of its ties
        return act, (sub >= act).sum(-1) if rank else None

    def log_normalizer(self, sub: torch.Tensor) -> torch.Tensor:
        """[p, 1]: the row max and sum-exp in one pass (the gather kernel's partial mode with no
        candidate) where torch's logsumexp makes three and a [p, V] temporary."""
        none = torch.full((sub.shape[0], 1), -1, dtype=torch.int64, device=sub.device)
        m, se, _ = gather_logprobs_partial(sub, none, 0)
        return (torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(se))[:, None]

    def masked_normalizer(self, sub: torch.Tensor) -> torch.Tensor:
        """``log_normalizer`` of rows that may be all -inf (a tail with nothing left): -inf there."""
        return torch.logsumexp(sub, dim=-1, keepdim=True)

    def top_k(self, sub: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k(sub, k)

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.argmax(-1)

    def mask_ids_(self, sub: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return mask_ids_(sub, ids)


@dataclass
class _VocabShard(_WholeVocab):
    """The same reductions over this rank's vocabulary shard (ids from ``start``), combined
    across ranks as ``vocab_parallel`` says."""

    start: int
    tp: TensorParallel

    def candidates(self, logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool) -> torch.Tensor:
        return vp.candidate_logprobs(logits, cand, self.start, logits_mode, self.tp.group)

    def actual_and_rank(self, sub: torch.Tensor, actual: torch.Tensor,
                        rank: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        return vp.actual_and_rank(sub, actual, self.start, rank, self.tp.group)

    def log_normalizer(self, sub: torch.Tensor) -> torch.Tensor:
        return vp.log_normalizer(sub, self.tp.group)

    def masked_normalizer(self, sub: torch.Tensor) -> torch.Tensor:
        return vp.log_normalizer(sub, self.tp.group)  # (its merge is safe for all -inf rows)

    def top_k(self, sub: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return vp.top_k(sub, k, self.start, self.tp)

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        return vp.argmax(rows, self.start, self.tp)

    def mask_ids_(self, sub: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return mask_ids_(sub, ids, self.start)


def score_rows(hidden: torch.Tensor, head: VocabRows, plan: ScoringPlan, logits_mode: bool,
               chunk_rows: int, tp: TensorParallel = SINGLE) -> ScoringOutput:
    """hidden: [R, H] final-normed; head: the layer of the [V, H] output weight (the LM head
    or the tied embedding), which makes the float32 logits (with tp > 1 of its vocab shard
    [Vr, H], ids from ``head.vocab_start``: the shards are combined as ``vocab_parallel``
    says, collectives per chunk)."""
    ops = _WholeVocab() if tp.size == 1 else _VocabShard(head.vocab_start, tp)
    r = hidden.shape[0]
    out = _empty_output(r, plan, hidden.device)
    n_p, n_a = (0 if x is None else x.numel() for x in (plan.plp_rows, plan.argmax_rows))
    for r0 in range(0, r, chunk_rows):
        r1 = min(r0 + chunk_rows, r)
        logits = head.logits(hidden[r0:r1])  # [r, V] float32 (with tp > 1: [r, Vr], this rank's shard)
        if n_a:  # the greedy token of the unscaled logits (a large T would tie them in float32), and before
            a, b = np.searchsorted(plan.argmax_rows_host, [r0, r1])  # the plp rows: their tail masks in place
            if b > a:
                out.argmax[a:b] = ops.argmax(logits[plan.argmax_rows[a:b] - r0])
        if plan.row_temp is not None:  # vLLM's processed_logprobs: logits / T, then log_softmax
            logits.div_(plan.row_temp[r0:r1, None])
        if out.scores is not None:
            out.scores[r0:r1] = ops.candidates(logits, plan.cand[r0:r1], logits_mode)
        if n_p:
            a, b = np.searchsorted(plan.plp_rows_host, [r0, r1])
            if b > a:
                lo, hi = int(plan.plp_rows_host[a]), int(plan.plp_rows_host[b - 1]) + 1
                # [p, V]: a view where the rows are one run (the row targets: a request's rows), else a copy
                sub = logits[lo - r0:hi - r0] if hi - lo == b - a else logits[plan.plp_rows[a:b] - r0]
                act, rank = ops.actual_and_rank(sub, plan.plp_actual[a:b], plan.want_rank)
                if rank is not None:
                    out.plp_rank[a:b] = rank
                norm = ops.log_normalizer(sub) if not logits_mode or plan.want_lse else None  # [p, 1]
                lse = 0.0 if logits_mode else norm
                if norm is not None:
                    out.plp_lse[a:b] = norm.squeeze(1)
                out.plp_actual[a:b] = (act - lse).squeeze(1)
                if plan.plp_k:
                    v, out.plp_topk_ids[a:b] = ops.top_k(sub, plan.plp_k)
                    out.plp_topk_vals[a:b] = v - lse
                if out.plp_tail is not None:
                    out.plp_tail[a:b] = _tail(ops, sub, plan, a, b, out.plp_topk_ids, lse)
        del logits
    return out


def _tail(ops: _WholeVocab, sub: torch.Tensor, plan: ScoringPlan, a: int, b: int, topk_ids: torch.Tensor | None,
          lse: torch.Tensor | float) -> torch.Tensor:
    """[p] log of the mass outside each plp row's set (its candidates and its first ``tail_k``
    top-k ids) in the units of the returned values (log-probs; logits in raw_logits mode):
    the log-sum-exp of the row with the set masked, minus the normaliser. Masks ``sub`` (a
    view or a copy of the chunk's rows) in place: it is the last use of them."""
    k_row = plan.tail_k[a:b]  # [p]
    rows = plan.plp_rows[a:b]  # [p] into R
    parts = []
    if plan.kmax:
        parts.append(plan.cand[rows])  # [p, Kc] -1 pads
    if topk_ids is not None and plan.plp_k:
        cols = torch.arange(plan.plp_k, device=sub.device)[None, :]
        parts.append(topk_ids[a:b].masked_fill(cols >= k_row[:, None], -1))  # [p, k]: this row's top_k
    if parts:
        ops.mask_ids_(sub, torch.cat(parts, dim=1))
    return (ops.masked_normalizer(sub) - lse).squeeze(1)
