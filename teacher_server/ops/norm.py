"""RMSNorm as the forward computes it (the eager definitions ``FusedOps`` compiles).

The math follows transformers exactly where it rounds: the residual sum is rounded to the
activation dtype before its float32 norm; RMSNorm casts back before the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., n]) with weight [n]."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # eager CUDA: torch's fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and the next block's input."""
    s = x + delta
    return s, rms_norm(s, weight, eps)
