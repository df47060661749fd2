"""SiLU-mul, the gated activation after the fused gate/up projection."""

from __future__ import annotations

import torch

from teacher_server.layers.runtime import RuntimeModule


class SiluAndMul(RuntimeModule):
    """[T, 2I] -> [T, I]: silu(gate) * up (``FusedOps.silu_mul``: the CUDA kernel when on)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.rt.ops.silu_mul(gate_up)
