"""gather_logprobs: per row, log-softmax over the vocabulary (float32) gathered at K
candidate ids; ``-1`` candidates give ``-inf``. The torch reference is used on CPU."""

from __future__ import annotations

import torch


def gather_logprobs_reference(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """logits: [R, V] float32/bf16; cand: [R, K] or [K] int; returns [R, K] float32."""
    x = logits.float()
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(x.shape[0], -1)
    idx = cand.long()
    pad = idx < 0
    vals = x.gather(1, idx.clamp(min=0))
    if not logits_mode:
        vals = vals - torch.logsumexp(x, dim=-1, keepdim=True)
    return vals.masked_fill(pad, float("-inf"))


def gather_logprobs(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """Dispatch to the CUDA kernel where available, else the reference."""
    return gather_logprobs_reference(logits, cand, logits_mode)
