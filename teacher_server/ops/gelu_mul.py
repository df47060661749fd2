"""GELU(tanh)-mul, the gated activation of Gemma's MLP after the fused gate/up projection
(a stage of ``FusedOps``: compiled into one pass over [T, 2I] where compiling is on)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: gelu_tanh(gate) * up, in the input dtype as transformers computes it
    (with tensor parallel the halves are this rank's gate and up columns)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
