"""``QueueWait``: admission by estimated wait. The tokens queued ahead of a new request (same
or more urgent priority: the scheduler takes requests in (priority, arrival) order), at the
throughput measured while requests were waiting, is the time it would wait; beyond
``max_queue_wait_s`` it is refused with 429 and a Retry-After of the excess. Plain Python, on
the event loop; fed by the generate endpoint for the single engine and the replica pool alike.

The throughput is tokens answered per second of saturated time (time with at least one forward
step's worth of tokens queued: the engines' step budgets, summed over replicas), with exponential
forgetting over ``TAU_S`` of that time: idle hours do not dilute it, and it follows a change of
workload within a minute. Time with less queued is left out, and so are the tokens answered in it:
there a step is part-filled and a request's time is mostly fixed cost, so a few small requests
would measure a tiny fraction of the capacity a backlog gets (a 9-token request alone had made
a burst of work that cleared in 6 s look like 20 minutes). Until ``MIN_BUSY_S`` of saturated time
and ``MIN_STEPS`` steps' answers counted in it have been seen there is no estimate and nothing is
refused by this rule (``max_queue_tokens`` still holds): a fresh server's first steps run part
filled (the burst is still arriving) and, on the CPU, beside the front's parsing of that burst,
so its first second measured a fifth of the rate its first batch then cleared at (CPU, ``-dp 2``,
256 requests at once: 130 of them refused for 29 s of a queue that took 8 s)."""

from __future__ import annotations

import math
import time


class QueueTooLong(Exception):
    """The estimated wait is past ``max_queue_wait_s``: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, retry_after_s)


class _Step:
    """One step end's answers: whether the queue was saturated before the first of them left it
    (so each of them counts alike), when that was decided, and whether the step has been counted
    towards ``QueueWait._steps``."""

    __slots__ = ("saturated", "at", "counted")

    def __init__(self, saturated: bool, at: float) -> None:
        self.saturated, self.at, self.counted = saturated, at, False


class QueueWait:
    TAU_S = 30.0
    MIN_BUSY_S = 2.0
    MIN_STEPS = 8
    KEEP_S = 10.0  # how long a step end's saturation is remembered after its first answer

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.by_priority: dict[int, int] = {}  # queued tokens per priority
        self.queued = 0
        self._busy_s = 0.0  # forgetting sums: saturated seconds and tokens answered in them
        self._done = 0.0
        self._seen_busy_s = 0.0  # saturated time ever seen (without forgetting)
        self._steps = 0  # steps whose answers were counted (an answer naming no step: one step)
        self._last = time.monotonic()
        self._budgets: dict[int | None, int] = {}  # each engine's (replica's) step budget, tokens
        self._saturation = 0  # their sum; 0: none known yet
        self._saturated_at: dict[float, _Step] = {}  # per step end (``ScoreResult.finished_at``)

    def step_budget(self, replica: int | None, tokens: int) -> None:
        """An engine's tokens per forward step (``replica`` None: the one engine). Any thread:
        the table is replaced, never changed in place, and its sum read as one number."""
        budgets = {**self._budgets, replica: tokens}
        self._budgets, self._saturation = budgets, sum(budgets.values())

    @property
    def saturated(self) -> bool:
        """Whether a full step's worth of every engine is queued (never before a budget is known)."""
        return 0 < self._saturation <= self.queued

    def _advance(self, now: float) -> None:
        dt = max(now - self._last, 0.0)
        self._last = now
        if dt > 0 and self.saturated:
            keep = math.exp(-dt / self.TAU_S)
            self._busy_s = self._busy_s * keep + dt
            self._done *= keep
            self._seen_busy_s += dt

    def rate(self) -> float | None:
        """Measured throughput, tokens/s; None before there is a measurement."""
        if self._seen_busy_s < self.MIN_BUSY_S or self._steps < self.MIN_STEPS or self._done <= 0 \
                or self._busy_s <= 0:
            return None
        return self._done / self._busy_s

    def ahead(self, priority: int) -> int:
        return sum(n for p, n in self.by_priority.items() if p <= priority)

    def refuse(self, priority: int, now: float | None = None) -> float | None:
        """Seconds to wait before a retry when a request of ``priority`` must be refused now;
        None when it may be admitted."""
        self._advance(time.monotonic() if now is None else now)
        rate = self.rate()
        if self.limit_s is None or rate is None:
            return None
        wait = self.ahead(priority) / rate
        return wait - self.limit_s if wait > self.limit_s else None

    def admit(self, priority: int, tokens: int, now: float | None = None) -> None:
        self._advance(time.monotonic() if now is None else now)
        self.by_priority[priority] = self.by_priority.get(priority, 0) + tokens
        self.queued += tokens

    def finish(self, priority: int, tokens: int, answered: bool, now: float | None = None,
               step_end: float | None = None) -> None:
        """A request admitted with ``admit`` has left the queue; ``answered``: it was scored
        (its tokens count towards the throughput; a cancelled or failed one's do not).
        ``step_end``: when the engine finished it (``ScoreResult.finished_at``, the same for every
        answer of one step): a step's answers reach here one by one, milliseconds apart (each
        handler wakes in turn, between others' answer encoding), and each counts as the queue was
        before the step's first one left it, not as the earlier ones left it."""
        self.finish_many([(priority, tokens, answered, step_end)], now)

    def finish_many(self, done: list[tuple[int, int, bool, float | None]], now: float | None = None) -> None:
        """Several requests (``(priority, tokens, answered, step_end)`` as ``finish`` takes) that
        leave the queue at once: a batch's prompts, answered over several steps and sent back
        together. Each step's saturation is settled before any of them leaves, so none is judged
        by a queue its own batch has already left."""
        now = time.monotonic() if now is None else now
        self._advance(now)
        # each answer's step, looked up once (a later lookup may find it pruned by another step's)
        steps = [None if step_end is None else self._step(step_end, now) for _, _, _, step_end in done]
        counted = [answered and (self.saturated if step is None else step.saturated)
                   for (_, _, answered, _), step in zip(done, steps)]
        for (priority, tokens, _, _), step, count in zip(done, steps, counted):
            if count:
                self._done += tokens
                if step is None:  # an answer naming no step: a step of its own
                    self._steps += 1
                elif not step.counted:  # its step's first counted answer
                    step.counted = True
                    self._steps += 1
            left = self.by_priority[priority] - tokens
            if left:
                self.by_priority[priority] = left
            else:
                del self.by_priority[priority]
            self.queued -= tokens

    def _step(self, step_end: float, now: float) -> _Step:
        """The step that ended at ``step_end`` (its saturation decided at its first answer, now).
        A step's answers all arrive within ``KEEP_S`` of its first: older steps are dropped (in
        the order they were decided), however many steps a batch's answers name at once."""
        seen = self._saturated_at.get(step_end)
        if seen is None:
            while self._saturated_at and next(iter(self._saturated_at.values())).at < now - self.KEEP_S:
                del self._saturated_at[next(iter(self._saturated_at))]
            self._saturated_at[step_end] = seen = _Step(self.saturated, now)
        return seen

    @property
    def estimated_wait_s(self) -> float:
        """The wait of a request of priority 0 arriving now (0 before a measurement)."""
        rate = self.rate()
        return 0.0 if rate is None else self.ahead(0) / rate
