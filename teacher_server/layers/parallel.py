"""Tensor-parallel placement of a layer: how many ranks split it, which one this is, which
slice of a dimension this rank holds, and the one collective the layers need (a sum over
ranks). Size 1 is the single-GPU case: every method is then a no-op or the whole range.

Slices:
- ``rows(n, what, unit)``: an even split of n rows in units (a head is ``head_dim`` rows). When
  there are fewer units than ranks (KV heads at TP past the KV head count) each unit is
  replicated: rank r holds unit ``r // (size // units)``, which is the KV head its query heads
  read (query heads are split evenly, so rank r's first query head / group size = that unit).
- ``vocab(n)``: an uneven split of the vocabulary (the first ``n % size`` ranks hold one row
  more), so any vocab size works without padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside tensor-parallel size {self.size}"

    def split(self, n: int, what: str) -> int:
        """This rank's share of n (rows, heads, ...); n must divide evenly."""
        assert n % self.size == 0, f"{what} = {n} does not split over {self.size} ranks"
        return n // self.size

    def rows(self, n: int, what: str, unit: int = 1) -> tuple[int, int]:
        """(first row, row count) of this rank's slice of n rows split in units of ``unit``
        rows; units are replicated when there are fewer of them than ranks."""
        assert n % unit == 0, f"{what} = {n} is not a whole number of units of {unit}"
        units = n // unit
        if units >= self.size:
            per = self.split(units, what)
            return self.rank * per * unit, per * unit
        assert self.size % units == 0, f"{what}: {units} units cannot be replicated evenly over {self.size} ranks"
        return (self.rank // (self.size // units)) * unit, unit

    def vocab(self, n: int) -> tuple[int, int]:
        """(first id, id count) of this rank's vocabulary shard of n ids (uneven when needed)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, base + (1 if self.rank < extra else 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks in place (the default process group); returns x."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x


SINGLE = TensorParallel()
