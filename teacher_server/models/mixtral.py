"""Mixtral: Mistral attention (sliding window when config.json gives one, else full) and
top-2 routed experts, renormalised; hub checkpoints name the experts
``block_sparse_moe.experts.E.w1 / w3 / w2`` (gate / up / down)."""

from __future__ import annotations

from teacher_server.models.llama import LlamaForCausalLM
from teacher_server.models.moe import MoeModel


class MixtralForCausalLM(MoeModel, LlamaForCausalLM):
    pass
