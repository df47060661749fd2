"""The attention backend interface: packed causal attention over a step's sequences, where
a sequence's queries may follow earlier keys (a cached prefix or earlier chunks; causal
alignment is bottom-right).

A step holds "prefixed" sequences first, then "fresh" ones (keys = their own queries),
each part longest first (``StepContext``). Every backend gets the step's q, k, v and the
packed ``[prefix | chunk]`` keys of the prefixed sequences (kp, vp).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from teacher_server.cache_layout import AttentionParams
from teacher_server.step_context import StepContext


@dataclass(slots=True)
class AttentionInputs:
    """One layer's attention operands for a step."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    kp: torch.Tensor | None = None  # [ctx.total_k, Hkv, D] packed keys of the prefixed sequences; None: none
    vp: torch.Tensor | None = None  # [ctx.total_k, Hkv, D]
    # [Hq] float32 learned sink logits (gpt-oss): one more logit per head in each softmax's
    # denominator, with no value; None: none. Backends that honour "sinks" take them.
    sinks: torch.Tensor | None = None


class AttentionBackend(ABC):
    """A backend is built once (its settings are constructor arguments) and called by every
    attention layer of every step. It may keep per-step plans in ``ctx.attn_plans``, one per
    (backend, ``AttentionParams.plan_key``): made by the first layer of each kind, reused by
    the others of that kind."""

    name: str = "base"
    # The optional attention arguments this backend honours ("window", "softcap"); a model
    # whose layers need another one is refused at start-up (``refusal``).
    honours: frozenset[str] = frozenset({"window"})
    # Whether values may be narrower than queries and keys (latent attention: q/k 192, v 128).
    # Where not, the layer pads v with zeros to the key width and drops the output's extra
    # columns (``models.mla``: 1.2x the attention FLOPs at 192/128).
    distinct_v_width: bool = False
    # Whether q and v may be strided views (latent attention: q rotated where its projection
    # wrote it, v read from kv_b_proj's output), not contiguous rows with slack around them.
    takes_views: bool = False

    @abstractmethod
    def __call__(self, x: AttentionInputs, ctx: StepContext, scale: float, window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
        """Causal attention of x.q over each sequence's keys; window: sliding-window length
        (keys at most window - 1 positions back) or None; softcap: logits become
        ``softcap * tanh(logits / softcap)`` before the softmax, or None. Returns [T, Hq, Dv]."""

    def refusal(self, needs: Iterable[AttentionParams]) -> str | None:
        """Why this backend cannot run layers with these arguments (None: it can)."""
        for p in needs:
            if p.window is not None and "window" not in self.honours:
                return f"attention backend {self.name!r} takes no sliding window (a layer has window {p.window})"
            if p.softcap is not None and "softcap" not in self.honours:
                return f"attention backend {self.name!r} takes no logit soft-cap (a layer has soft-cap {p.softcap})"
            if p.sinks and "sinks" not in self.honours:
                return f"attention backend {self.name!r} takes no attention sinks"
        return None

    def warm_up(self, max_len: int, hq: int, hkv: int, d: int, device: torch.device, dtype: torch.dtype,
                layers: int = 1, dv: int | None = None, views: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                ) -> float:
        """Prepare whatever the backend builds per shape for sequences up to max_len, before
        the first request (``layers``: attention layers per forward, each calling the backend
        with the step's plan; ``dv``: the values' width where it differs from ``d`` and the backend
        takes it, ``distinct_v_width``; ``views``: the strides of q and v as the layers hand them,
        where the backend ``takes_views``). Returns the seconds it took (nothing to do by default)."""
        return 0.0
