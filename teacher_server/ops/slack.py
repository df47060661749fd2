"""Step buffers with slack rows around them, so that the cuDNN attention backend can pad a
sequence to its bucketed length by viewing the neighbouring rows instead of copying."""

from __future__ import annotations

import torch


def slack_rows(n: int) -> int:
    """Rows of slack before and after a step's q/k/v (n rows) so that bucket padding and
    prefix-split offsets of the cuDNN backend are views, not copies (when they fit)."""
    return 64 + n // 8


def alloc_with_slack(like: torch.Tensor, t: int, h: int, d: int, front: bool = False) -> torch.Tensor:
    """[t, h, d] rows inside a larger buffer: zeroed slack rows after (and uninitialised ones
    before, when ``front``), which the cuDNN attention backend uses as padding without copies."""
    sl = slack_rows(t)
    f = sl if front else 0
    buf = like.new_empty(f + t + sl, h, d)
    buf[f + t:].zero_()
    return buf[f:f + t]


def with_slack(x: torch.Tensor | None) -> torch.Tensor | None:
    """x [t, h, d] itself where its rows are contiguous, else a copy of it with slack rows around
    (a strided view, such as latent attention's q and v, on a route that pads by viewing)."""
    if x is None or x.is_contiguous():
        return x
    out = alloc_with_slack(x, *x.shape, front=True)
    out.copy_(x)
    return out
