"""Tensor-parallel placement of a layer: how many ranks split it and which one this is.
One GPU today (size 1, rank 0); the split points are named in the layers so that sharded
loading and the collectives have one place each to go."""

from __future__ import annotations

from dataclasses import dataclass


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


SINGLE = TensorParallel()
