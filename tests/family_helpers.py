"""What the model families' CPU tests share: a checkpoint per tiny config made on first use,
the small CPU engine they score with, and the GRPO-like group their prefix-cache tests run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest, ScoreResult


def lazy_checkpoints(root: Path, make: Callable[[str, Path], Path]) -> dict[str, Path]:
    """config name -> checkpoint directory under ``root``, made by ``make(name, dir)`` when first asked."""

    class Lazy(dict):
        def __missing__(self, name: str) -> Path:
            self[name] = make(name, root / name)
            return self[name]

    return Lazy()


def cpu_engine(path: Path, budget: int = 32, **kw: object) -> Engine:
    """A CPU engine at a small step budget (sequences longer than it are chunked)."""
    return Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=budget, block_size=8,
                         num_kv_blocks=256, max_model_len=512, **kw))


def prefix_group(eng: Engine, vocab: int, members: int = 4,
                 min_cached: int = 40) -> tuple[list[ScoreRequest], list[ScoreResult]]:
    """One 45-token prompt with ``members`` responses: the first scored alone, then the rest,
    which must each have at least ``min_cached`` tokens served from the prefix cache. Returns
    the requests and their results, for the caller to check against its reference."""
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, vocab, 45)
    reqs = [ScoreRequest(f"g{j}", np.concatenate([prompt, rng.integers(0, vocab, 20 + 7 * j)]), 44,
                         rng.choice(vocab, 5, replace=False), max_tokens=1) for j in range(members)]
    first = eng.run_to_completion(reqs[:1])
    rest = eng.run_to_completion(reqs[1:])
    assert all(r.cached_tokens >= min_cached for r in rest), [r.cached_tokens for r in rest]
    return reqs, first + rest
