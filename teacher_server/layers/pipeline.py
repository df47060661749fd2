"""Pipeline-parallel placement of a model: which contiguous range of decoder layers this rank's
stage holds, whether it holds the embedding (the first stage) and the final norm, LM head and
scoring (the last), and the one hand-over between stages: the residual stream [T, hidden] of a
step, sent point to point from each rank of stage s to the rank of the same tensor-parallel
rank in stage s + 1. Size 1 is the whole model on every rank.

Ranks: world = pipeline size x tensor-parallel size. Global rank 0 is the engine's own process
and sits in the LAST stage, so the results of a step are made where the engine reads them (no
send of result arrays back): ranks [0, tp) are stage P-1, [tp, 2 tp) stage P-2, ..., and the
last tp ranks stage 0 (``stage_ranks``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


def split_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of ``size`` stages, as even as possible; the first stages take one
    layer more where it does not divide (the last stage also runs the LM head and scoring)."""
    if not 1 <= size <= num_layers:
        raise ValueError(f"pipeline_parallel_size={size} needs between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, size)
    out, lo = [], 0
    for s in range(size):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def stage_ranks(stage: int, size: int, tp_size: int) -> list[int]:
    """Global ranks of pipeline stage ``stage`` (of ``size``), in tensor-parallel rank order."""
    first = (size - 1 - stage) * tp_size
    return list(range(first, first + tp_size))


def stage_of(rank: int, size: int, tp_size: int) -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank) of global rank ``rank``."""
    return size - 1 - rank // tp_size, rank % tp_size


@dataclass(frozen=True)
class PipelineStage:
    size: int = 1
    stage: int = 0
    lo: int = 0  # first layer held
    hi: int | None = None  # one past the last layer held; None: through the last
    prev_rank: int | None = None  # global rank this one receives the residual stream from (stage - 1)
    next_rank: int | None = None  # global rank it sends to (stage + 1)

    def __post_init__(self) -> None:
        assert 0 <= self.stage < self.size, f"stage {self.stage} outside pipeline size {self.size}"

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The model layer ids this stage holds."""
        return range(self.lo, num_layers if self.hi is None else self.hi)

    def send(self, x: torch.Tensor, dtype: torch.dtype) -> None:
        """Hand the residual stream [T, hidden] to the next stage (queued on CUDA's stream), in
        ``dtype``, the one the next stage's ``recv`` allocates (NCCL would not say otherwise)."""
        import torch.distributed as dist

        dist.send(x.to(dtype).contiguous(), self.next_rank)

    def recv(self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The residual stream [tokens, hidden] of this step from the previous stage."""
        import torch.distributed as dist

        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
        dist.recv(x, self.prev_rank)
        return x


WHOLE = PipelineStage()


def make_stage(rank: int, size: int, tp_size: int, num_layers: int) -> PipelineStage:
    """Global rank ``rank``'s stage of a model of ``num_layers`` layers over ``size`` stages."""
    if size == 1:
        return WHOLE
    stage, t = stage_of(rank, size, tp_size)
    lo, hi = split_layers(num_layers, size)[stage]
    prev = stage_ranks(stage - 1, size, tp_size)[t] if stage > 0 else None
    nxt = stage_ranks(stage + 1, size, tp_size)[t] if stage < size - 1 else None
    return PipelineStage(size, stage, lo, hi, prev, nxt)


class StageLayers(nn.Module):
    """The decoder layers a stage holds, registered under their model layer ids (``layers.17``)
    so checkpoint names find them; iterated and indexed in layer order (index 0: the stage's
    first layer), as an ``nn.ModuleList`` of them would be."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int | slice) -> nn.Module | list[nn.Module]:
        return list(self._modules.values())[i]
