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

``moe`` says how the same ranks split the expert layers: "tensor" (every expert's intermediate
dimension, as the dense MLP) or "expert" (whole experts, E / size each: ``layers.moe``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# The fewest rows a part of a row-parallel product is cut to (``TensorParallel.spans``), and
# the multiple of rows parts start at (whole GEMM row tiles).
COMM_PART_MIN_ROWS = 1024
COMM_PART_ALIGN = 256


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    # Parts a row-parallel product (o and down projections) is made in: each part's all-reduce
    # runs on the communicator's stream while the next part's GEMM runs (1: one GEMM, then one
    # all-reduce).
    comm_parts: int = 1
    moe: str = "tensor"  # the expert layers' split: "tensor" or "expert" (the module docstring)
    # The ranks' process group (a pipeline stage's, under pipeline parallel); None: the default
    # group, every rank of the process group.
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside tensor-parallel size {self.size}"
        assert self.moe in ("tensor", "expert"), f"moe split {self.moe!r}: tensor or expert"

    def split(self, n: int, what: str) -> int:
        """This rank's share of n (rows, heads, ...); n must divide evenly."""
        if n % self.size:  # (also under python -O: a wrong split would give wrong scores)
            raise ValueError(f"{what} = {n} does not split over {self.size} ranks")
        return n // self.size

    def rows(self, n: int, what: str, unit: int = 1) -> tuple[int, int]:
        """(first row, row count) of this rank's slice of n rows split in units of ``unit``
        rows; units are replicated when there are fewer of them than ranks."""
        if n % unit:
            raise ValueError(f"{what} = {n} is not a whole number of units of {unit}")
        units = n // unit
        if units >= self.size:
            per = self.split(units, what)
            return self.rank * per * unit, per * unit
        if self.size % units:
            raise ValueError(f"{what}: {units} units cannot be replicated evenly over {self.size} ranks")
        return (self.rank // (self.size // units)) * unit, unit

    def heads(self, n_q: int, n_kv: int) -> tuple[int, int]:
        """This rank's (query heads, KV heads): query heads split evenly, KV heads split or,
        past their count, replicated (``rows`` in units of one head). The one place a rank's
        head layout is decided."""
        return self.split(n_q, "query heads"), self.rows(n_kv, "kv heads")[1]

    def vocab(self, n: int) -> tuple[int, int]:
        """(first id, id count) of this rank's vocabulary shard of n ids (uneven when needed)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, base + (1 if self.rank < extra else 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks in place (the default process group); returns x."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def spans(self, rows: int) -> list[tuple[int, int]]:
        """[lo, hi) row spans a row-parallel product of ``rows`` rows is made and all-reduced
        in: ``comm_parts`` of them (fewer where a part would have under COMM_PART_MIN_ROWS
        rows), starting at multiples of COMM_PART_ALIGN; one span at size 1."""
        n = 1 if self.size == 1 else max(1, min(self.comm_parts, rows // COMM_PART_MIN_ROWS))
        if n == 1:
            return [(0, rows)]
        per = -(-rows // n)
        step = -(-per // COMM_PART_ALIGN) * COMM_PART_ALIGN
        return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]

    def all_reduce_parts(self, out: torch.Tensor, make: Callable[[int, int], None],
                         spans: list[tuple[int, int]]) -> torch.Tensor:
        """Fill ``out`` [rows, ...] span by span (``spans``, as ``self.spans(rows)`` made them):
        ``make(lo, hi)`` writes this rank's partial sums into ``out[lo:hi]``, then that span's
        all-reduce starts on the communicator's stream while the next span is made; the caller's
        stream waits for them all (the host does not). Returns out, summed over the ranks."""
        import torch.distributed as dist

        works = []
        for lo, hi in spans:
            make(lo, hi)
            works.append(dist.all_reduce(out[lo:hi], async_op=True, group=self.group))
        for w in works:
            w.wait()
        return out


SINGLE = TensorParallel()
