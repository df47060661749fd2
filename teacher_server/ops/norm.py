"""RMSNorm as the forward computes it (the eager definitions ``FusedOps`` compiles).

The math follows transformers exactly where it rounds: the residual sum is rounded to the
activation dtype before its float32 norm; RMSNorm casts back before the weight.

A float32 weight on half-precision activations is the zero-centred norm of the Qwen3.5
families: its weight holds ``1 + w`` unrounded (``layers.norm.ZeroCenteredRMSNorm``), and the
scaling happens in float32 before the one rounding, as transformers computes
``(norm(x.float()) * (1 + w.float())).to(x.dtype)``. Weights in the activation dtype (every
other family) take the unchanged path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., n]) with weight [n]."""
    if weight.dtype != x.dtype:  # float32 weight: scale in float32, round once
        if x.is_cuda and not torch.compiler.is_compiling():
            return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)
    if x.is_cuda and not torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # eager CUDA: torch's fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x) * silu(gate)`` over the last dim (x, gate [..., n], gate may be
    strided; weight [n]): the output norm of the Gated DeltaNet layers, float32 throughout and
    rounded once to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and the next block's input."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def norm_add_rms_norm(x: torch.Tensor, delta: torch.Tensor, post: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + rms_norm(delta, post), its rms_norm with ``weight``): Gemma's post-norm of a block's
    output, the residual add and the next block's input norm, one compiled stage."""
    return add_rms_norm(x, rms_norm(delta, post, eps), weight, eps)


def norm_add(x: torch.Tensor, delta: torch.Tensor, post: torch.Tensor, eps: float) -> torch.Tensor:
    """x + rms_norm(delta, post): ``norm_add_rms_norm`` without the next block's norm (a
    pipeline stage's last layer before the last stage; the next stage norms what it receives)."""
    return x + rms_norm(delta, post, eps)
