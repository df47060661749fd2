"""Sequence: a request's progress through the engine (chunks done, KV blocks and linear-state
slots held). No torch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from teacher_server.engine.block_manager import block_hashes
from teacher_server.engine.request import ScoreRequest, ScoreResult

_counter = itertools.count()


@dataclass(eq=False)  # identity semantics: hashable, cheap `in` checks
class Sequence:
    req: ScoreRequest
    block_size: int
    prefix_caching: bool
    order: int = field(default_factory=lambda: next(_counter))
    num_computed: int = 0  # tokens [0, num_computed) done (their KV is in the pool if needed later)
    num_cached: int = 0  # of which reused from the prefix cache
    num_registered: int = 0  # cacheable blocks already registered in the prefix cache
    block_table: list[int] = field(default_factory=list)
    result: ScoreResult | None = None
    # Linear-attention state slots (hybrid models, ``StateSlots``; 0 = none). The scheduler
    # keeps them; each slot this sequence names in ``state_slot``, ``state_read`` or
    # ``snapshot_slot`` holds one reference of it.
    state_slot: int = 0  # working slot, held from admission to the end when processed in chunks
    state_src: int = 0  # where the state after the last scheduled chunk is (0: the zero state)
    state_read: int = 0  # a snapshot the next (or the scheduled) chunk starts from
    snapshot_slot: int = 0  # the snapshot at cache_end the scheduled chunk writes (bound when it ran)
    aborted: bool = False  # dropped (``Scheduler.abort``): a step that scheduled it leaves it alone

    def __post_init__(self) -> None:
        self.logit_lo, self.logit_hi = self.req.logit_range()
        # Tokens at or after the last logit position need no forward at all.
        self.num_tokens = self.logit_hi
        # Full blocks wholly before the first logit row may come from / go to the cache.
        self.cache_end = (self.logit_lo // self.block_size) * self.block_size if self.prefix_caching else 0
        self._hashes: list[bytes] | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def hashes(self) -> list[bytes]:
        if self._hashes is None:
            self._hashes = block_hashes(self.req.token_ids, self.cache_end // self.block_size,
                                        self.block_size, self.req.cache_salt)
        return self._hashes

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def max_blocks(self) -> int:
        """Upper bound on blocks this sequence holds at once if it is processed in chunks."""
        return -(-self.num_tokens // self.block_size)

    def slots(self, start: int, end: int) -> np.ndarray:
        """Pool slot ids of positions [start, end): [end - start] int64."""
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(self.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class Chunk:
    """Positions [start, end) of one sequence computed in this step; KV of [start, write_end)
    is written to the pool. Hybrid models: the linear layers start from state slot
    ``state_in`` (0: the zero state, ``start`` is 0) and keep their end state in slot
    ``state_out`` (0: not kept)."""

    seq: Sequence
    start: int
    end: int
    write_end: int
    state_in: int = 0
    state_out: int = 0

    @property
    def final(self) -> bool:
        return self.end == self.seq.num_tokens

    @property
    def logit_lo(self) -> int:
        return max(self.start, self.seq.logit_lo)

    @property
    def logit_hi(self) -> int:
        return min(self.end, self.seq.logit_hi)

    # The three uses of this chunk's logit rows [logit_lo, logit_hi), as position ranges
    # (empty ranges have b <= a). Shared by step preparation and result scatter.
    def cand_positions(self) -> tuple[int, int]:
        """Positions scored against candidates: [max(lo, start), min(hi, L-1)); to L with
        ``next_candidates`` (the last position, whose logits the next token needs anyway)."""
        req = self.seq.req
        if req.candidates is None:
            return 0, 0
        assert not req.next_candidates or (req.max_tokens >= 1 and not req.per_row), \
            f"next_candidates needs shared candidates and max_tokens 1 (request {req.request_id!r})"
        return max(self.logit_lo, req.start), min(self.logit_hi, req.length - 1 + req.next_candidates)

    def plp_positions(self) -> tuple[int, int]:
        """Positions needing classic prompt_logprobs or the row targets: [lo, min(hi, L-1))
        (the targets' rows are those from ``req.start``)."""
        req = self.seq.req
        if req.plp_cols is None and not req.row_targets:
            return 0, 0
        return self.logit_lo, min(self.logit_hi, req.length - 1 + (req.next_top is not None))

    @property
    def has_next_token(self) -> bool:
        """This chunk holds the last position and the request wants the greedy next token."""
        return self.seq.req.max_tokens >= 1 and self.logit_hi == self.seq.req.length
