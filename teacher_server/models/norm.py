"""The RMSNorm a family's decoder uses (layer, final and q/k norms), as its spec says, and a
residual add with the next norm (or none, at a pipeline stage's end)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from teacher_server.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from teacher_server.models.spec import ModelSpec

if TYPE_CHECKING:
    from teacher_server.ops.fused import FusedOps


def decoder_norm(spec: ModelSpec, size: int, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    """Zero-centred where the spec says so (Qwen3.5: ``norm(x) * (1 + w)``), plain otherwise."""
    cls = ZeroCenteredRMSNorm if spec.zero_centered_norm else RMSNorm
    return cls(size, spec.rms_norm_eps, dtype, device)


def add_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm | None, ops: FusedOps,
             reader: nn.Module | None = None) -> tuple[torch.Tensor, object | None]:
    """(x + delta, its RMSNorm with ``norm``); without a norm (a pipeline stage's last layer
    before the last stage: the next norm is the next stage's) the sum alone, rounded as the
    fused stage rounds it, and None. ``reader``: the one linear layer reading the normed rows,
    where its weight format takes them made in the same pass (FP8: quantized there)."""
    if norm is None:
        return x + delta, None
    if reader is not None and type(norm) is RMSNorm and ops.fp8_norm_input:
        got = reader.fmt.norm_input(reader, x, norm.weight, norm.eps, delta)
        if got is not None:
            return got
    return ops.add_rms_norm(x, delta, norm.weight, norm.eps)
