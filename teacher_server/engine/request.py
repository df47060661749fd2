"""ScoreRequest (validated input to the engine) and ScoreResult (what it returns).

Plain Python + numpy: no torch here."""

from __future__ import annotations

import enum
import itertools
import sys
import time
from dataclasses import dataclass, field

import numpy as np

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: its members are their values as strings too (metric labels, messages)
    class StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__

_uids = itertools.count()


class ErrorKind(StrEnum):
    """Why a request failed (``ScoreResult.error_kind``; the async engine's exceptions
    carry OVERLOADED and UNAVAILABLE). The server maps each to an HTTP status."""

    TIMEOUT = "timeout"  # its deadline passed before it finished
    CANCELLED = "cancelled"  # its caller stopped waiting (client disconnect)
    INTERNAL = "internal"  # the step running it failed, or the engine died
    OVERLOADED = "overloaded"  # not admitted: the queue is full
    UNAVAILABLE = "unavailable"  # not admitted: draining for shutdown, or the engine is down


@dataclass
class ScoreRequest:
    """One scoring request, already validated.

    Row ``i`` of the candidate matrix scores token ``start + i + 1`` given
    ``token_ids[: start + i + 1]``; ``rows = max(len(token_ids) - 1 - start, 0)``.

    ``request_id`` is the caller's (echoed back; two callers may use the same one);
    the engine keys requests by ``uid``, unique in the process.
    """

    request_id: str
    token_ids: np.ndarray  # [L] int64
    start: int = 0
    candidates: np.ndarray | None = None  # [K] shared or [rows, K] per row, int32, -1 = padding
    prompt_logprobs: int | None = None  # classic top-k over every position
    max_tokens: int = 0  # 1: also return the greedy next token
    # Targets over the scored rows (the candidate rows [start, L-1)), from the same logits:
    top_k: int = 0  # the teacher's own top-K ids and log-probs per row
    union: bool = False  # candidates + the teacher's top-K ids not among them (built from both)
    actual: bool = False  # the log-prob of the actual next token
    tail: bool = False  # log of the probability mass outside candidates and top-K
    logsumexp: bool = False  # the row's log normalizer
    temperature: float = 1.0  # logits / temperature before the softmax (vLLM's processed_logprobs)
    # The classic reductions at the last position too (the next token's distribution: entry
    # L-1 of the prompt_logprobs arrays), ``next_top`` columns wide: the OpenAI ``logprobs`` of
    # a generated token.
    next_top: int | None = None
    # Shared candidates scored at the last position too (the next token's distribution; needs
    # max_tokens 1): ``token_id_logprobs`` has one row more, the last (SGLang's
    # ``output_token_ids_logprobs`` of a generated token).
    next_candidates: bool = False
    cache_salt: str | None = None
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # through HTTP (time.monotonic()): when the server began handling it (its headers read), and
    # when its body was whole; ``arrival`` is then when it was parsed
    received: float | None = None
    body_read: float | None = None
    handed: float | None = None  # when the engine's process queued it for the engine thread (a replica: after the pipe)
    deadline: float | None = None  # time.monotonic() value
    uid: int = field(default_factory=lambda: next(_uids), init=False)

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def rows(self) -> int:
        return max(self.length - 1 - self.start, 0)

    @property
    def candidate_rows(self) -> int:
        """Rows of ``token_id_logprobs``: the scored rows, and the next token's with ``next_candidates``."""
        return self.rows + self.next_candidates

    @property
    def k(self) -> int:
        return 0 if self.candidates is None else int(self.candidates.shape[-1])

    @property
    def row_targets(self) -> bool:
        """Anything other than candidates asked of the scored rows (computed with the classic
        prompt_logprobs' reductions: top-k, actual token, log normalizer)."""
        return bool(self.top_k or self.actual or self.tail or self.logsumexp)

    @property
    def plp_width(self) -> int:
        """Top-k columns this request needs from the classic prompt_logprobs' reductions."""
        return max(self.prompt_logprobs or 0, self.top_k, self.next_top or 0)

    @property
    def plp_cols(self) -> int | None:
        """Columns of the result's prompt_logprobs arrays (None: the request has none)."""
        if self.prompt_logprobs is None and self.next_top is None:
            return None
        return max(self.prompt_logprobs or 0, self.next_top or 0)

    @property
    def per_row(self) -> bool:
        return self.candidates is not None and self.candidates.ndim == 2

    def logit_range(self) -> tuple[int, int]:
        """Positions [lo, hi) whose hidden state must reach the LM head ([0, 0) if none).
        Candidate rows need [start, L-1); prompt_logprobs [0, L-1); max_tokens=1 {L-1}."""
        lo, hi = None, 0
        n = self.length
        if (self.candidates is not None or self.row_targets) and self.rows > 0:
            lo, hi = self.start, n - 1
        if self.prompt_logprobs is not None and n > 1:
            lo, hi = 0, n - 1
        if self.max_tokens >= 1:
            lo = n - 1 if lo is None else lo
            hi = n
        return (0, 0) if lo is None else (lo, hi)


@dataclass
class ScoreResult:
    request_id: str  # the caller's
    uid: int  # the request's ScoreRequest.uid
    prompt_tokens: int
    token_id_logprobs: np.ndarray | None = None  # [rows, K] float32
    # classic prompt_logprobs for positions 1..L-1 (entry j scores token j)
    plp_token_logprob: np.ndarray | None = None  # [L-1] float32
    plp_token_rank: np.ndarray | None = None  # [L-1] int64
    plp_topk_ids: np.ndarray | None = None  # [L-1, k] int64
    plp_topk_logprobs: np.ndarray | None = None  # [L-1, k] float32
    # the row targets (``ScoreRequest.top_k`` ...), one entry per scored row
    topk_ids: np.ndarray | None = None  # [rows, top_k] int32
    topk_logprobs: np.ndarray | None = None  # [rows, top_k] float32
    actual_logprobs: np.ndarray | None = None  # [rows] float32
    tail_logprobs: np.ndarray | None = None  # [rows] float32
    logsumexp: np.ndarray | None = None  # [rows] float32
    next_token: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None
    scheduled_at: float = 0.0  # first step that computed it (time.monotonic())
    finished_at: float = 0.0

    @classmethod
    def empty_for(cls, req: ScoreRequest) -> ScoreResult:
        """The result arrays a request's steps fill in."""
        res = cls(req.request_id, req.uid, req.length)
        if req.candidates is not None:
            res.token_id_logprobs = np.full((req.candidate_rows, req.k), np.nan, dtype=np.float32)
        if req.plp_cols is not None:
            n, k = max(req.length - 1, 0) + (req.next_top is not None), req.plp_cols
            res.plp_token_logprob = np.zeros(n, dtype=np.float32)
            res.plp_token_rank = np.zeros(n, dtype=np.int64)
            res.plp_topk_ids = np.zeros((n, k), dtype=np.int64)
            res.plp_topk_logprobs = np.zeros((n, k), dtype=np.float32)
        if req.top_k:
            res.topk_ids = np.zeros((req.rows, req.top_k), dtype=np.int32)
            res.topk_logprobs = np.zeros((req.rows, req.top_k), dtype=np.float32)
        for name, wanted in (("actual_logprobs", req.actual), ("tail_logprobs", req.tail),
                             ("logsumexp", req.logsumexp)):
            if wanted:
                setattr(res, name, np.zeros(req.rows, dtype=np.float32))
        return res

    @classmethod
    def failed(cls, req: ScoreRequest, kind: ErrorKind, message: str) -> ScoreResult:
        return cls(req.request_id, req.uid, req.length, error=message, error_kind=kind,
                   finished_at=time.monotonic())


def prompt_logprob_entries(token_ids: np.ndarray, res: ScoreResult) -> list[list[tuple[int, float, int]] | None]:
    """vLLM's classic prompt_logprobs layout: entry 0 None; entry j lists
    (token id, logprob, rank) with the actual token j first, then the top-k by rank
    (without repeating the actual token, which then has its top-k value and rank: vLLM's
    entry is a dict by id, the top-k's written over the token's own)."""
    toks = token_ids.tolist()
    lp, rk = res.plp_token_logprob.tolist(), res.plp_token_rank.tolist()
    ids, vals = res.plp_topk_ids.tolist(), res.plp_topk_logprobs.tolist()
    out: list[list[tuple[int, float, int]] | None] = [None]
    for j in range(1, len(toks)):
        a = toks[j]
        at = ids[j - 1].index(a) if a in ids[j - 1] else -1
        entry = [(a, lp[j - 1], rk[j - 1]) if at < 0 else (a, vals[j - 1][at], at + 1)]
        entry += [(t, v, r) for r, (t, v) in enumerate(zip(ids[j - 1], vals[j - 1]), start=1) if t != a]
        out.append(entry)
    return out
