"""What a model keeps per token and per sequence, as the model declares it (``cache_layout()``)
and the engine, the KV pool, the memory planner and the attention backends read it.

Per attention layer (``AttentionCache``): its kind (``full``, ``sliding`` with a window,
``latent``: one vector per token holding what keys and values are made from), this rank's
heads, the key and value widths (a value may be narrower than its key, or absent where the
layer keeps only a latent), and the attention arguments the backends must honour (scale,
window, logit soft-cap). Per sequence (``LinearStateLayout``): the convolution and recurrent
states of linear-attention layers.

Plain data: nothing here imports torch beyond the dtype it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FULL, SLIDING, LATENT = "full", "sliding", "latent"
KINDS = (FULL, SLIDING, LATENT)


@dataclass(frozen=True)
class AttentionParams:
    """What one attention layer asks of a backend besides q, k and v: the softmax scale, a
    sliding window (keys at most ``window - 1`` positions back; None: all of them) and a
    logit soft-cap (``cap * tanh(s / cap)`` before the softmax; None: none). Backends plan
    a step per distinct ``plan_key`` (the window decides which keys a query sees; the scale
    and the cap only how they weigh)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False  # per-head learned sink logits in the softmax (``AttentionInputs.sinks``)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window {self.window}: at least 1 (a query sees itself)")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention logit soft-cap {self.softcap}: positive or None")

    @property
    def plan_key(self) -> int | None:
        return self.window


@dataclass(frozen=True)
class AttentionCache:
    """One attention layer's cache on this rank: per token, ``heads`` keys of ``k_dim`` and
    values of ``v_dim`` (0: the layer keeps no separate values, as a latent layer)."""

    layer: int  # model layer id
    kind: str  # FULL, SLIDING or LATENT
    heads: int  # KV heads held by this rank (replicated past their count under tensor parallel)
    k_dim: int
    v_dim: int
    params: AttentionParams
    q_heads: int = 0  # this rank's query heads (the backends' warm-up shapes); 0: as heads
    # A latent layer: (heads, key width, value width) of the keys and values it makes from the
    # latent for attention (what the backends see, and a step's working memory); None: as kept.
    expands_to: tuple[int, int, int] | None = None
    # The element strides of q and of v ([T, heads, width] each) as a latent layer hands them to
    # a backend that ``takes_views`` (q where its projection wrote it, v inside kv_b_proj's
    # output); None: contiguous.
    views: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer {self.layer}: cache kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == SLIDING) != (self.params.window is not None):
            raise ValueError(f"layer {self.layer}: a {self.kind} layer with window {self.params.window}")
        if self.heads < 1 or self.k_dim < 1 or self.v_dim < 0:
            raise ValueError(f"layer {self.layer}: {self.heads} heads of k {self.k_dim} / v {self.v_dim}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(heads, k width, v width): layers of one shape share an allocation in the pool."""
        return self.heads, self.k_dim, self.v_dim

    def bytes_per_token(self, itemsize: int) -> int:
        return self.heads * (self.k_dim + self.v_dim) * itemsize

    @property
    def attn_shape(self) -> tuple[int, int, int]:
        """(KV heads, key width, value width) the attention backend is called with."""
        return self.expands_to or self.shape

    def working_bytes_per_token(self, itemsize: int) -> int:
        """Bytes a gathered key takes in a step: as kept, plus its heads' keys and values
        where they are made from a latent."""
        h, k, v = self.expands_to or (0, 0, 0)
        return self.bytes_per_token(itemsize) + h * (k + v) * itemsize


@dataclass(frozen=True)
class LinearStateLayout:
    """What a hybrid model's linear layers keep per sequence (this rank's shares)."""

    layers: tuple[int, ...]  # model layer ids of the linear layers
    conv_shape: tuple[int, ...]  # one slot of one layer's convolution state (the model's layout)
    rec_shape: tuple[int, ...]  # one slot of one layer's recurrent state: (v_heads, k_dim, v_dim)
    conv_dtype: torch.dtype  # the model dtype; the recurrent state is always float32

    def slot_bytes(self) -> int:
        """Bytes of one slot over all linear layers."""
        conv = math.prod(self.conv_shape) * self.conv_dtype.itemsize
        return len(self.layers) * (conv + math.prod(self.rec_shape) * 4)


@dataclass(frozen=True)
class CacheLayout:
    """A model's whole cache declaration on this rank."""

    attention: tuple[AttentionCache, ...]  # the layers with paged KV, in layer order
    dtype: torch.dtype  # of keys and values
    state: LinearStateLayout | None = None  # per-sequence linear-attention state; None: no linear layers

    def __post_init__(self) -> None:
        ids = [c.layer for c in self.attention]
        if ids != sorted(set(ids)):
            raise ValueError(f"attention cache layers {ids}: each once, in order")
        if self.state is not None and set(ids) & set(self.state.layers):
            raise ValueError(f"layers {sorted(set(ids) & set(self.state.layers))} have KV and linear state")

    @classmethod
    def uniform(cls, kv_layers: tuple[int, ...], heads: int, head_dim: int, dtype: torch.dtype,
                state: LinearStateLayout | None = None) -> CacheLayout:
        """Every listed layer full attention with ``heads`` KV heads of ``head_dim`` (keys and
        values alike, scale head_dim^-0.5)."""
        params = AttentionParams(head_dim ** -0.5)
        return cls(tuple(AttentionCache(i, FULL, heads, head_dim, head_dim, params) for i in kv_layers), dtype, state)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(c.layer for c in self.attention)

    def bytes_per_token(self) -> int:
        """Bytes of KV one token takes over all attention layers (this rank)."""
        return sum(c.bytes_per_token(self.dtype.itemsize) for c in self.attention)

    def params(self) -> tuple[AttentionParams, ...]:
        """The distinct attention arguments of the model's layers (what a backend must honour)."""
        return tuple(dict.fromkeys(c.params for c in self.attention))

    def widest(self) -> AttentionCache | None:
        """The layer with the most key bytes (the memory planner's per-layer activation bound)."""
        return max(self.attention, key=lambda c: c.heads * (c.k_dim + c.v_dim), default=None)
