"""The row end of an expert-parallel rank's activations: its rows are sorted by expert with
its own experts' first, so only rows before the last row end (``offs[-1]`` of the grouped
GEMM, a one-element int32 tensor on the rows' device) are ever read; the others' rows after
it need no activation. The CUDA kernels read the end on the device and skip the rest; the
host reads it only where that waits for nothing (the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def host_row_end(end: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """How many leading rows of ``x`` a torch op over rows needs: ``end`` read on the CPU;
    None (all rows) without an end or on a GPU, where reading it would sync the host."""
    if end is None or x.device.type != "cpu":
        return None
    return max(0, min(int(end), x.shape[0]))


def before_end(fn: Callable[..., torch.Tensor], x: torch.Tensor, end: torch.Tensor | None, width: int,
               *rows: torch.Tensor) -> torch.Tensor:
    """``fn(x, *rows)`` ([M, ...] -> [M, width], row by row) on the rows before ``end`` where
    the host can read it for free, the rows after it left unwritten; else on every row.
    ``rows``: further per-row inputs, cut alike."""
    n = host_row_end(end, x)
    if n is None or n == x.shape[0]:
        return fn(x, *rows)
    out = x.new_empty(x.shape[0], width)
    out[:n] = fn(x[:n], *(r[:n] for r in rows))
    return out
