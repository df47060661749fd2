"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's hybrid decoder (Gated DeltaNet layers,
gated full attention every ``full_attention_interval``-th layer with zero-centred q/k norms
and partial rotary, the expert layer with a sigmoid-gated shared expert), the same math;
what differs is read from config.json or the checkpoint:

- the linear layers' in-projections are two fused tensors, ``in_proj_qkvz`` and
  ``in_proj_ba``, grouped by key head: per key head g, [q_g | k_g | v of its value heads |
  z of its value heads] and [b of its value heads | a of its value heads]; they are taken
  apart at load into the Qwen3.5 in-projection's parts (q, k, v, z, b, a, each head-major);
- ``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` as config.json says
  (dense layers of ``intermediate_size`` where they apply).
"""

from __future__ import annotations

import torch

from teacher_server.layers.linear import Slice
from teacher_server.models.gated_delta import GatedDeltaNet, InProjection
from teacher_server.models.qwen3_5 import Qwen3_5ForCausalLM
from teacher_server.models.qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeForCausalLM


class GroupedInProjection(InProjection):
    """The in-projection filled from ``in_proj_qkvz`` and ``in_proj_ba`` (read whole; each
    sub-part then as Qwen3.5's separate tensors, this rank's heads cut from it)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)
        spec = args[0]
        self.groups = spec.linear_num_key_heads
        self.per_group = spec.linear_num_value_heads // spec.linear_num_key_heads  # value heads per key head
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim

    def shards(self, param: str) -> int:
        return 2  # in_proj_qkvz, in_proj_ba

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return None if part in ("qkvz", "ba") else super().checkpoint_slice(param, part)

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        g, r, dk, dv = self.groups, self.per_group, self.dk, self.dv
        if part == "qkvz":
            sizes, subs = [dk, dk, r * dv, r * dv], ("q", "k", "v", "z")
        else:
            assert part == "ba", f"{name}: part {part!r}"
            sizes, subs = [r, r], ("b", "a")
        grouped = loaded.view(g, sum(sizes), *loaded.shape[1:])  # [key heads, their rows, hidden]
        for sub, rows in zip(subs, grouped.split(sizes, dim=1)):
            InProjection.load_weight(self, param, rows.reshape(-1, *loaded.shape[1:]), sub, name)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    in_projection = GroupedInProjection


class Qwen3NextDecoderLayer(Qwen3_5MoeDecoderLayer):
    linear_mixer = Qwen3NextGatedDeltaNet


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    decoder_layer = Qwen3NextDecoderLayer
    stacked = Qwen3_5ForCausalLM.stacked + (
        (".in_proj_qkvz.", ".in_proj.", "qkvz"), (".in_proj_ba.", ".in_proj.", "ba"),
    )
