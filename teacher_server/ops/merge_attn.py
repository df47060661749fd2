"""merge_attn: two partial attentions of the same queries over disjoint key sets, merged
by their log-sum-exps (the cuDNN backend's prefix split). A CUDA kernel
(``kernels/elementwise.cu``) with the torch reference beside it."""

from __future__ import annotations

import torch

from teacher_server.ops import extension
from teacher_server.ops.silu_mul import HALF, aligned


def merge_attn_reference(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """o1, o2: [c, H, D]; l1, l2: [H, c] float32 log-sum-exps. Returns [c, H, D] in o1's dtype."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    tot = w1 + w2
    tot = torch.where(tot > 0, tot, torch.ones_like(tot))
    w1, w2 = (w1 / tot).t()[:, :, None], (w2 / tot).t()[:, :, None]  # [c, H, 1]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def merge_attn(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """Write the merged attention into out ([c, H, D]) and return it."""
    ok = all(t.is_cuda and t.dtype in HALF and t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0
             and aligned(t) for t in (o1, o2, out)) and o1.shape[-1] % 8 == 0
    if ok and l1.dtype == torch.float32 and l2.dtype == torch.float32:
        ext = extension.load()
        if ext is not None:
            ext.merge_attn_out(o1, l1, o2, l2, out)
            return out
    return out.copy_(merge_attn_reference(o1, l1, o2, l2))
