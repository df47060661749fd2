"""The sdpa backend: per-sequence ``scaled_dot_product_attention`` (CPU, float32; the
reference every other backend is checked against)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teacher_server.attention.base import AttentionBackend, AttentionInputs
from teacher_server.step_context import StepContext


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
             softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence, [lq, Hq, D] x [lk, Hkv, Dv] -> [lq, Hq, Dv]; bottom-right causal; sinks
    [Hq]: one more logit per head in the softmax, with no value."""
    lq, lk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qi, ki, vi = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if groups > 1:
        ki = ki.repeat_interleave(groups, dim=0)
        vi = vi.repeat_interleave(groups, dim=0)
    if lq == lk and window is None and softcap is None and sinks is None:
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    kpos = torch.arange(lk, device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
    else:  # the logits capped before the mask and the softmax (in the inputs' dtype, as transformers)
        s = (qi @ ki.transpose(1, 2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf")).float()
        if sinks is not None:  # the sink column joins the softmax, then is dropped
            sink = sinks.float()[:, None, None].expand(-1, lq, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        o = p.to(vi.dtype) @ vi
    return o.transpose(0, 1)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    honours = frozenset({"window", "softcap", "sinks"})
    distinct_v_width = True
    takes_views = True

    def __call__(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
        out = x.q.new_empty(*x.q.shape[:2], x.v.shape[2])
        qs = ks = 0
        for i, (lq, lk) in enumerate(zip(ctx.q_lens, ctx.k_lens)):
            if i < ctx.n_prefixed:
                ki, vi = x.kp[ks:ks + lk], x.vp[ks:ks + lk]
                ks += lk
            else:
                ki, vi = x.k[qs:qs + lq], x.v[qs:qs + lq]
            out[qs:qs + lq] = sdpa_one(x.q[qs:qs + lq], ki, vi, scale, window, softcap, x.sinks)
            qs += lq
        return out
