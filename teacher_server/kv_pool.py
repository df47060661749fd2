"""KVPool: the one owner of the paged KV cache tensors. Layers store a step's keys and
values through it, gather the packed keys of prefixed sequences from it, and nobody else
indexes its tensors.

Layout: one allocation ``[layers, 2 (k/v), slots, kv_heads, head_dim]``; slot
``block * block_size + offset`` is a token position of a block the block manager handed
out. Per-sequence state of other kinds goes next to it in the same owner when a model needs
it: a linear-attention (Gated DeltaNet) layer keeps a convolution state and a float32
recurrent state per sequence instead of KV, so the pool would hold, beside the paged KV of
the attention layers, ``[linear_layers, state_slots, ...]`` tensors indexed by a per-sequence
state slot that the block manager hands out with a sequence's blocks (and a snapshot slot at
a prefix-reuse boundary), with ``load_state`` / ``store_state`` for a layer and the step's
state slots. Layer indices then map to either kind; the attention layers' calls stay as here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from teacher_server.ops.slack import alloc_with_slack

if TYPE_CHECKING:
    from teacher_server.step_context import StepContext


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers, self.num_slots = num_layers, num_slots
        # One allocation: [layers, 2 (k/v), slots, kv_heads, head_dim]
        self._kv = torch.empty(num_layers, 2, num_slots, kv_heads, head_dim, dtype=dtype, device=device)
        self._views = [(self._kv[i, 0], self._kv[i, 1]) for i in range(num_layers)]  # made once, not per step

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return self._kv.numel() * self._kv.element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer: [slots, kv_heads, head_dim] (a view)."""
        return self._views[layer][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of one layer: [slots, kv_heads, head_dim] (a view)."""
        return self._views[layer][1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        """Write this step's keys and values (k, v: [T, kv_heads, head_dim]) of the tokens the
        scheduler asked for (``ctx.write_src``) into their slots (``ctx.write_slots``)."""
        if ctx.write_slots is not None:
            kc, vc = self._views[layer]
            kc[ctx.write_slots] = k[ctx.write_src]
            vc[ctx.write_slots] = v[ctx.write_src]

    def store_target(self, layer: int,
                     ctx: StepContext) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(k_cache, v_cache, per-token slots [T] int64, -1 = not written) for a kernel that
        writes the step's keys and values as it makes them; all None when the step writes
        nothing."""
        if ctx.tok_slots is None:
            return None, None, None
        kc, vc = self._views[layer]
        return kc, vc, ctx.tok_slots

    def gather_prefixed(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                        ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed ``[cached prefix | chunk]`` keys and values of the prefixed sequences (the
        step's first ``ctx.tok_prefixed`` tokens), in ``ctx.cu_k`` order: [ctx.total_k,
        kv_heads, head_dim] each, with slack rows after them (the cuDNN backend pads into
        them). k, v: this step's [T, kv_heads, head_dim]."""
        kc, vc = self._views[layer]
        tp, h, d = ctx.tok_prefixed, k.shape[1], k.shape[2]
        kp = alloc_with_slack(k, ctx.total_k, h, d)
        vp = alloc_with_slack(v, ctx.total_k, h, d)
        kp[ctx.new_pos] = k[:tp]
        vp[ctx.new_pos] = v[:tp]
        kp[ctx.prefix_pos] = kc[ctx.prefix_slots]
        vp[ctx.prefix_pos] = vc[ctx.prefix_slots]
        return kp, vp
