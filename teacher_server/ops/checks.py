"""The comparison every start-up check of an op makes: its fast version against its torch
reference on random inputs, within a bound relative to the reference's magnitude; and the
timing a warm-up makes where a kernel is kept only if it is faster (``median_ms``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2, floor: float = 1e-3) -> None:
    """Raise RuntimeError naming ``name`` when max |got - ref| exceeds rel * max |ref| + floor."""
    err = (got.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    bound = rel * (ref.float().abs().max().item() if ref.numel() else 0.0) + floor
    if not err <= bound:  # also catches NaN
        raise RuntimeError(f"{name} differs from its torch reference by {err:.3g} (bound {bound:.3g})")


def error_stats(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(relative RMS error, worst error over the largest reference magnitude, slope - 1) of
    ``got`` against ``ref`` (float32 tensors of one shape); the slope is the least-squares
    factor of got on ref: a scale error moves it, rounding does not."""
    err, tiny = got - ref, 1e-30
    rel = (err.norm() / ref.norm().clamp_min(tiny)).item()
    worst = (err.abs().max() / ref.abs().max().clamp_min(tiny)).item()
    return rel, worst, ((got * ref).sum() / (ref * ref).sum().clamp_min(tiny)).item() - 1


def assert_same_picks(name: str, got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
                      scores: torch.Tensor, tie: float, what: str, tied: torch.Tensor | None = None) -> None:
    """A router kernel's (weights, ids) [T, k] against its torch path's: a row may pick other
    experts only where the two picks' ``scores`` ([T, E], sorted) pair up within ``tie`` (a tie
    within float32 noise), or where ``tied`` ([T] bool) says a tie upstream of the picks makes
    either right (a group-limited router's groups at its cut); elsewhere the weights, by expert
    id, within 1e-5 relative. RuntimeError naming ``name`` (and ``what`` the scores are) otherwise."""
    (w, ids), (rw, rids) = got, ref
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    for r in torch.nonzero(~same if tied is None else ~same & ~tied).flatten().tolist():
        gap = (scores[r, ids[r]].sort().values - scores[r, rids[r]].sort().values).abs().max().item()
        if not gap <= tie:
            raise RuntimeError(f"{name} picks {sorted(ids[r].tolist())}, the torch path "
                               f"{sorted(rids[r].tolist())} ({what} {gap:.3g} apart)")
    a, b = w.gather(1, ids.argsort(-1))[same], rw.gather(1, rids.argsort(-1))[same]
    if not bool(((a - b).abs() <= 1e-5 * b.abs() + 1e-7).all()):
        raise RuntimeError(f"{name} weights differ by {(a - b).abs().max().item():.3g}")


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


def faster(name: str, ours: Callable[[], object], theirs: Callable[[], object], against: str, detail: str,
           margin: float = 0.03) -> bool:
    """Whether ``ours`` runs at least ``margin`` faster than ``theirs`` (``median_ms``); logs both
    times: "<name> X ms against Y ms for <against> (<detail>)"."""
    a, b = median_ms([ours, theirs])
    log.info("%s %.3f ms against %.3f ms for %s (%s)", name, a, b, against, detail)
    return a <= (1 - margin) * b
