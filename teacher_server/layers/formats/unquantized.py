"""Unquantized: weights held as they are computed with, in the model dtype (bf16, fp16 or
float32), one parameter per slot under the slot's name (``layer.weight``, ``experts.gate_up``),
multiplied by torch's GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.formats.base import GroupedMM, WeightFormat


class Unquantized(WeightFormat):
    name = "unquantized"

    def create(self, layer: nn.Module, slot: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
        setattr(layer, slot, nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.linear(x, layer.weight, layer.bias)  # [T, out]
        return torch.mm(x, layer.weight.t(), out=out)

    def add_into(self, layer: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.addmm_(x, layer.weight.t())

    def epilogue_add(self, layer: nn.Module) -> bool:
        return True

    def dense(self, layer: nn.Module, slot: str = "weight") -> torch.Tensor:
        return getattr(layer, slot)

    def apply_experts(self, layer: nn.Module, slot: str, x: torch.Tensor, offs: torch.Tensor,
                      gemm: GroupedMM) -> torch.Tensor:
        return gemm(x, getattr(layer, slot).transpose(1, 2), offs)  # [E, in, out]: a view of the [E, out, in] stack


UNQUANTIZED = Unquantized()
