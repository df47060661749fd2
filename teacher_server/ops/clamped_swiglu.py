"""gpt-oss's expert activation, a stage of ``FusedOps`` (compiled: one pass that reads the
gate/up rows and their experts' bias rows and writes the activation; eager: a chain of
full-size passes). Its own torch reference: the compiled and eager forms are the same code."""

from __future__ import annotations

import torch


def clamped_swiglu(gate_up: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gate_up [M, 2I] (gate columns, then up), plus ``bias[rows]`` ([E, 2I] indexed by the
    [M] expert ids) -> [M, I] in gate_up's dtype: gate = min(gate, limit), up = clamp(up,
    -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), in float32."""
    n = gate_up.shape[1] // 2
    gu = gate_up.float() + bias.index_select(0, rows).float()
    gate = gu[:, :n].clamp(max=limit)
    up = gu[:, n:].clamp(-limit, limit)
    return ((up + 1.0) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)
