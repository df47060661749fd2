"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (QKV bias), routed experts and a
shared expert every token takes, scaled by sigmoid(shared_expert_gate(h)) (the design the
Qwen3.5 MoE models reuse)."""

from __future__ import annotations

from teacher_server.models.llama import LlamaForCausalLM
from teacher_server.models.moe import MoeModel


class Qwen2MoeForCausalLM(MoeModel, LlamaForCausalLM):
    pass
