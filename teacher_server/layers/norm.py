"""RMSNorm: the weight of one norm and its eps, applied through the bound ``FusedOps``
(compiled or eager; ``residual_norm`` in a model fuses it with the residual add)."""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.layers.linear import copy_checked
from teacher_server.layers.runtime import RuntimeModule


class RMSNorm(RuntimeModule):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rt.ops.rms_norm(x, self.weight, self.eps)

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.weight.data, loaded, name)  # replicated on every rank


class ZeroCenteredRMSNorm(RMSNorm):
    """The Qwen3.5 RMSNorm, ``norm(x) * (1 + w)``: the checkpoint holds w; ``weight`` holds
    ``1 + w`` in float32 whatever the model dtype, so bf16 never rounds it (``ops.norm``
    scales in float32 when the weight is float32)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(size, eps, torch.float32, device)

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.weight.data, 1.0 + loaded.float(), name)
