"""The synthetic requests the engine scores at start-up, shaped like serving: the first step
and the first use of each path happen there (kernel builds, cuDNN plans, the prefix cache and
state snapshots of hybrid models), not inside a request."""

from __future__ import annotations

import numpy as np

from teacher_server.engine.request import ScoreRequest

# what each batch of ``warm_up_plan`` is, for the log line that says where warm-up spends
WARM_UP_BATCHES = ("full-budget steps", "a shared prompt", "a lone short sequence")


def warm_up_plan(vocab: int, cap: int, budget: int, block: int) -> list[list[ScoreRequest]]:
    """Batches to score one after another (the shared prompt is cached before its second use),
    random ids with per-row candidates of K = 4: a step of the full token ``budget`` over
    several sequences of odd lengths and one longer than the budget (its state carried from
    chunk to chunk on hybrid models); two responses to one ``block``-aligned prompt (a prefix
    hit; a state snapshot on hybrids); a lone short sequence. No sequence exceeds ``cap``."""
    rng = np.random.default_rng(0)

    def req(n: int, start: int | None = None, prefix: np.ndarray | None = None) -> ScoreRequest:
        head = np.zeros(0, np.int64) if prefix is None else prefix
        toks = np.concatenate([head, rng.integers(0, vocab, max(min(n, cap) - len(head), 1))])[:cap]
        start = len(toks) // 2 if start is None else min(start, len(toks) - 1)
        cand = rng.integers(0, vocab, (max(len(toks) - 1 - start, 0), 4))
        return ScoreRequest(f"warm-up-{len(toks)}", toks.astype(np.int64), start, cand)

    prompt = rng.integers(0, vocab, min(4 * block, cap // 2))
    return [[req(budget // 6 + 2 * i + 1) for i in range(6)] + [req(budget + budget // 2)],
            [req(len(prompt) + 40 + i, len(prompt) - 1, prompt) for i in range(2)],
            [req(37)]]
