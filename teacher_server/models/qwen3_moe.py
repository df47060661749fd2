"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k-norm) and routed experts,
softmax top-k with ``norm_topk_prob``; layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` are dense."""

from __future__ import annotations

from teacher_server.models.moe import MoeModel
from teacher_server.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoeModel, Qwen3ForCausalLM):
    pass
