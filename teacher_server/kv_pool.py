"""KVPool: the one owner of a model's per-token and per-sequence cache tensors. Layers store
a step's keys and values through it, gather the packed keys of prefixed sequences from it,
read and write their linear-attention state in it, and nobody else indexes its tensors.

Paged KV, for the attention layers the model's ``CacheLayout`` declares (model layer ids):
one allocation per shape of layer, ``[layers, 2 (k/v), slots, kv_heads, head_dim]`` (keys
and values apart where their widths differ); slot ``block * block_size + offset`` is a
token position of a block the block manager handed out. Every method takes the model layer
id and maps it.

Linear-attention state, for a hybrid model's Gated DeltaNet layers (``LinearStateLayout``):
per layer ``[state_slots, *conv_shape]`` convolution states (model dtype) and
``[state_slots, *rec_shape]`` float32 recurrent states, indexed by a state slot that the
engine hands out (``engine/state_slots.py``). Slot 0 is the zero state: zero from
allocation and never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from teacher_server.cache_layout import CacheLayout
from teacher_server.ops.slack import alloc_with_slack

if TYPE_CHECKING:
    from teacher_server.step_context import StepContext


class KVPool:
    def __init__(self, num_slots: int, layout: CacheLayout, device: torch.device, state_slots: int = 0) -> None:
        """``num_slots``: KV token slots (blocks x block size); ``layout``: what each layer
        keeps (the model's ``cache_layout()``); ``state_slots``: linear-state slots, slot 0
        (the zero state) included (at least 2 with a linear-state layout)."""
        state = layout.state
        self.num_slots, self.layout, self.state, self.state_slots = num_slots, layout, state, state_slots
        self.kv_layers = layout.kv_layers
        # One allocation per shape of layer (heads, k width, v width): [layers, 2 (k/v), slots,
        # heads, width] where keys and values are as wide, else keys and values apart (values
        # absent where a layer keeps none). Sliding-window layers keep every token too: a
        # prefix cached for one request may be read by another from any position.
        self._buffers: list[torch.Tensor] = []
        groups: dict[tuple[int, int, int], list[int]] = {}
        for c in layout.attention:
            groups.setdefault(c.shape, []).append(c.layer)
        n = max((*self.kv_layers, *(state.layers if state else ())), default=-1) + 1
        # Indexed by model layer id (None for a linear layer); made once, not per step.
        self._views: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * n
        for (heads, kd, vd), layers in groups.items():
            if kd == vd:
                kv = torch.empty(len(layers), 2, num_slots, heads, kd, dtype=layout.dtype, device=device)
                self._buffers.append(kv)
                views = [(kv[i, 0], kv[i, 1]) for i in range(len(layers))]
            else:
                k = torch.empty(len(layers), num_slots, heads, kd, dtype=layout.dtype, device=device)
                v = torch.empty(len(layers), num_slots, heads, vd, dtype=layout.dtype, device=device) if vd else None
                self._buffers += [t for t in (k, v) if t is not None]
                views = [(k[i], None if v is None else v[i]) for i in range(len(layers))]
            for layer, view in zip(layers, views):
                self._views[layer] = view
        self._conv: torch.Tensor | None = None
        self._rec: torch.Tensor | None = None
        self._state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer id -> (conv, rec) views
        if state is not None:
            assert state_slots >= 2, f"state_slots={state_slots}: the zero slot and at least one more"
            # Zeroed: slot 0 is the zero state and stays so (the engine never hands it out).
            nl = len(state.layers)
            self._conv = torch.zeros(nl, state_slots, *state.conv_shape, dtype=state.conv_dtype, device=device)
            self._rec = torch.zeros(nl, state_slots, *state.rec_shape, dtype=torch.float32, device=device)
            self._state = {layer: (self._conv[i], self._rec[i]) for i, layer in enumerate(state.layers)}

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors (KV and linear state)."""
        return sum(t.numel() * t.element_size() for t in (*self._buffers, self._conv, self._rec) if t is not None)

    def conv_state(self, layer: int) -> torch.Tensor:
        """Convolution states of a linear layer: [state_slots, *conv_shape], model dtype (a view)."""
        return self._state[layer][0]

    def rec_state(self, layer: int) -> torch.Tensor:
        """Recurrent states of a linear layer: [state_slots, *rec_shape] float32 (a view)."""
        return self._state[layer][1]

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer: [slots, kv_heads, head_dim] (a view)."""
        return self._views[layer][0]

    def v_cache(self, layer: int) -> torch.Tensor | None:
        """Values of one layer: [slots, kv_heads, v width] (a view); None where it keeps none."""
        return self._views[layer][1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None:
        """Write this step's keys and values (k, v: [T, kv_heads, head_dim]) of the tokens the
        scheduler asked for (``ctx.write_src``) into their slots (``ctx.write_slots``)."""
        if ctx.write_slots is not None:
            kc, vc = self._views[layer]
            kc[ctx.write_slots] = k[ctx.write_src]
            if vc is not None:
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
                        ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed ``[cached prefix | chunk]`` keys and values of the prefixed sequences (the
        step's first ``ctx.tok_prefixed`` tokens), in ``ctx.cu_k`` order: [ctx.total_k,
        kv_heads, head_dim] each, with slack rows after them (the cuDNN backend pads into
        them). k, v: this step's [T, kv_heads, head_dim]."""
        kc, vc = self._views[layer]
        tp, h, d = ctx.tok_prefixed, k.shape[1], k.shape[2]
        kp = alloc_with_slack(k, ctx.total_k, h, d)
        kp[ctx.new_pos] = k[:tp]
        kp[ctx.prefix_pos] = kc[ctx.prefix_slots]
        if vc is None:  # the layer keeps no values
            return kp, None
        vp = alloc_with_slack(v, ctx.total_k, h, v.shape[2])
        vp[ctx.new_pos] = v[:tp]
        vp[ctx.prefix_pos] = vc[ctx.prefix_slots]
        return kp, vp
