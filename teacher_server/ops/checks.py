"""The comparison every start-up check of an op makes: its fast version against its torch
reference on random inputs, within a bound relative to the reference's magnitude; and the
timing a warm-up makes where a kernel is kept only if it is faster (``median_ms``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2, floor: float = 1e-3) -> None:
    """Raise RuntimeError naming ``name`` when max |got - ref| exceeds rel * max |ref| + floor."""
    err = (got.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    bound = rel * (ref.float().abs().max().item() if ref.numel() else 0.0) + floor
    if not err <= bound:  # also catches NaN
        raise RuntimeError(f"{name} differs from its torch reference by {err:.3g} (bound {bound:.3g})")


def median_ms(fns: list[Callable[[], object]], reps: int = 12, skip: int = 2) -> list[float]:
    """Median CUDA-event milliseconds of each of ``fns``, called in turn ``reps`` times (the first
    ``skip`` rounds, compiles and cold caches, not counted)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        for fn, got in zip(fns, times):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            if i >= skip:
                got.append(a.elapsed_time(b))
    return [sorted(t)[len(t) // 2] for t in times]
