"""The RMSNorm a family's decoder uses (layer, final and q/k norms), as its spec says."""

from __future__ import annotations

import torch

from teacher_server.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from teacher_server.models.spec import ModelSpec


def decoder_norm(spec: ModelSpec, size: int, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    """Zero-centred where the spec says so (Qwen3.5: ``norm(x) * (1 + w)``), plain otherwise."""
    cls = ZeroCenteredRMSNorm if spec.zero_centered_norm else RMSNorm
    return cls(size, spec.rms_norm_eps, dtype, device)
