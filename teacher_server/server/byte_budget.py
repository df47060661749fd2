"""``ByteBudget``: one bound on the bytes every request in flight holds together (bodies being
read and their parsed copies, admitted requests' arrays, results waiting to be sent), so that
many concurrent large bodies cannot take the host's memory: the per-body limit
(``max_body_bytes``) alone lets N clients hold N times it. Plain Python, on the event loop."""

from __future__ import annotations

import math

from teacher_server.engine.request import ScoreRequest

# What a body of declared size costs while it is read and parsed, per byte: the bytes
# themselves (read into one buffer) and their parsed copy (orjson's strings and lists; a large
# ignored field is copied whole).
BODY_FACTOR = 2
# A chunked body (size unknown) is read as a list of parts joined at the end; the freed parts
# stay resident in the allocator's arenas while the joined bytes are parsed: one more copy.
CHUNKED_FACTOR = 3
# What a result matrix costs until its answer is sent, per float32 byte: the matrix, its
# base64 text (4/3) and the JSON body holding that text (4/3 again): about 3.7, taken as 4.
RESULT_FACTOR = 4
PLP_ENTRY_BYTES = 140  # a classic prompt_logprobs entry: ~70 bytes of JSON, and its Python objects while built


class OverBudget(Exception):
    """A request would take the bytes in flight past the budget: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ByteBudget:
    """Bytes held against ``limit``. ``take(n)`` holds n more when they fit (or when nothing
    is held but the taker's own ``own`` bytes: one request larger than the whole budget still
    runs, alone, also when its share grows from its body to its answer), else returns False;
    ``give(n)`` returns them. Every ``take`` that succeeded is paired with a ``give``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0  # the most ever held (tests and metrics read it)

    def take(self, n: int, own: int = 0) -> bool:
        if n > 0 and self.used > own and self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, f"returned more bytes than were held (used {self.used} after giving {n})"

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the budget frees as answers are sent, about a
        second for each budget's worth of bytes held (at least 1)."""
        return max(1, math.ceil(self.used / max(self.limit, 1)))


def held_bytes(token_count: int, rows: int, k: int, prompt_logprobs: int | None) -> int:
    """What an admitted request holds until its answer is sent: its token ids and candidates
    (int64), and its result's estimated size (matrix, base64 and JSON; classic entries)."""
    arrays = 8 * (token_count + rows * k)
    result = RESULT_FACTOR * 4 * rows * k
    if prompt_logprobs is not None:
        result += PLP_ENTRY_BYTES * max(token_count - 1, 0) * (prompt_logprobs + 1)
    return arrays + result


def native_held_bytes(req: ScoreRequest) -> int:
    """``held_bytes`` of a request of the native endpoint, whose row targets come back as binary
    arrays beside the candidates' matrix: the top-K ids and log-probs, the union's ids and
    log-probs, and a float per row for each of actual, tail and log-sum-exp."""
    rows, top = req.rows, req.top_k
    cells = 2 * rows * top + rows * (req.actual + req.tail + req.logsumexp)
    if req.union:
        cells += 2 * rows * (req.k + top)
    return held_bytes(req.length, req.rows, req.k, req.prompt_logprobs) + RESULT_FACTOR * 4 * cells


def json_held_bytes(req: ScoreRequest) -> int:
    """``held_bytes`` of a request whose row targets are answered as JSON entries (the
    trainers' endpoints: one entry per candidate, top-K id and actual token of each row)
    rather than as binary arrays."""
    entries = req.rows * (req.k + req.top_k + 1) if req.row_targets else 0
    return held_bytes(req.length, req.rows, req.k, req.prompt_logprobs) + PLP_ENTRY_BYTES * entries


class Hold:
    """One request's share of a ``ByteBudget``: grown, resized and released as the request
    goes from its body to its answer; ``release`` is safe to call more than once."""

    def __init__(self, budget: ByteBudget | None) -> None:
        self.budget, self.n = budget, 0

    def take(self, n: int) -> bool:
        """Hold ``n`` bytes more; False (nothing taken) when they do not fit."""
        if self.budget is None:
            return True
        if not self.budget.take(n, self.n):
            return False
        self.n += n
        return True

    def resize(self, n: int) -> bool:
        """Hold ``n`` bytes in all: a shrink always succeeds, a growth when it fits."""
        if n <= self.n:
            if self.budget is not None:
                self.budget.give(self.n - n)
            self.n = min(self.n, n)
            return True
        return self.take(n - self.n)

    def release(self) -> None:
        if self.budget is not None and self.n:
            self.budget.give(self.n)
        self.n = 0


def over_budget(hold: Hold, need: int = 0) -> OverBudget:
    """The refusal of a request whose bytes do not fit ``hold``'s budget; ``need``: what it
    would hold in all (one larger than the whole budget runs only alone, and is told so)."""
    b = hold.budget
    assert b is not None, "a hold without a budget never refuses"
    others = b.used - hold.n  # (what this request holds already is not another's)
    if need > b.limit:
        return OverBudget(f"server busy: this request needs {need >> 20} MiB in flight, more than the whole "
                          f"{b.limit >> 20} MiB budget (max_inflight_bytes), so it runs only while no other request "
                          f"holds any ({others >> 20} MiB held by others now); retry when the server is idle, split "
                          "it, or raise max_inflight_bytes", b.retry_after_s())
    return OverBudget(f"server busy: the other requests in flight hold {others >> 20} MiB of the {b.limit >> 20} MiB "
                      f"budget (max_inflight_bytes) and this one needs {need >> 20} MiB; retry later",
                      b.retry_after_s())
