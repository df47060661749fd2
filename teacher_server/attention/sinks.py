"""Learned attention sinks (gpt-oss): each query head h has one more logit ``sink[h]`` in its
softmax's denominator, with no value. With the softmax's log-sum-exp ``lse`` over the keys
(of the scaled logits, as flash attention returns it), the sink only rescales each row:

    out_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)

so any backend that returns ``lse`` takes sinks with one elementwise pass over its output."""

from __future__ import annotations

import torch


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] of a softmax without sinks, lse its log-sum-exp [H, T] (flash attention's
    varlen layout) float32, sinks [H]: the output with sinks, in out's dtype (the factor in
    float32, rounded once)."""
    t, h = out.shape[0], out.shape[1]
    assert lse.shape == (h, t), f"log-sum-exp of shape {tuple(lse.shape)}, expected [heads {h}, tokens {t}]"
    factor = torch.sigmoid(lse.float().t() - sinks.float()[None, :])  # [T, H]
    return (out.float() * factor[..., None]).to(out.dtype)
