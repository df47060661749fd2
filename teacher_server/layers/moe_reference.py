"""The expert layer's output by a loop over experts, transformers' way: the definition the
grouped forward (``layers.moe.SparseMoe``) is tested against. Plain expert weights only; a
rank's part, not all-reduced."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def loop_reference(moe: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """[T, H] of ``moe`` (a ``layers.moe.SparseMoe``): each token's routed experts weighted and
    summed in float32, plus the shared expert (behind its gate where it has one), rounded once."""
    w, ids = moe.route(h)
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
    ex = moe.experts
    n, gate_up, down = ex.i_local, ex.fmt.dense(ex, "gate_up"), ex.fmt.dense(ex, "down")
    assert gate_up is not None and down is not None, f"the loop reference needs plain weights, not {ex.fmt.name}"
    for e in range(ex.num_local):
        tok, slot = torch.where(ids == ex.first + e)  # (an expert no token took adds nothing)
        gu = h[tok] @ gate_up[e].t()
        y = (F.silu(gu[:, :n]) * gu[:, n:]) @ down[e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    if moe.shared_expert is not None:
        s, g = moe.shared_expert, moe.shared_expert_gate
        gu = s.gate_up_proj(h).chunk(2, dim=1)
        shared = s.down_proj(F.silu(gu[0]) * gu[1])
        out += (1.0 if g is None else torch.sigmoid(g(h))) * shared.float()
    return out.to(h.dtype)
