"""Supported ``architectures`` of config.json: each names its family, the class that builds
it (imported on first use) and the family facts config.json leaves implicit. A new
family is one file in this package and one line here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Architecture:
    family: str
    model: str  # "module:Class" in teacher_server.models
    qk_norm: bool = False  # per-head RMSNorm of q and k
    attention_bias: bool = False  # QKV bias when config.json does not say
    sliding_window: bool = False  # config.json's sliding_window applies
    refuse_sliding_window: bool = False  # use_sliding_window: true is not supported
    moe: bool = False  # routed experts (num_experts, num_experts_per_tok, ... in config.json)
    always_norm_topk: bool = False  # top-k weights renormalised whatever config.json says (Mixtral)
    hybrid: bool = False  # Gated DeltaNet linear-attention layers among gated full-attention ones (Qwen3.5)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama:LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("mistral", "llama:LlamaForCausalLM", sliding_window=True),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama:LlamaForCausalLM", attention_bias=True,
                                     refuse_sliding_window=True),
    "Qwen3ForCausalLM": Architecture("qwen3", "qwen3:Qwen3ForCausalLM", qk_norm=True, refuse_sliding_window=True),
    # Mixture-of-experts families (layers/moe.py holds the expert layer).
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "qwen3_moe:Qwen3MoeForCausalLM", qk_norm=True,
                                        refuse_sliding_window=True, moe=True),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", "qwen2_moe:Qwen2MoeForCausalLM", attention_bias=True,
                                        refuse_sliding_window=True, moe=True),
    "MixtralForCausalLM": Architecture("mixtral", "mixtral:MixtralForCausalLM", sliding_window=True, moe=True,
                                       always_norm_topk=True),
    # Hybrid families: three of four layers are Gated DeltaNet (a recurrent state per sequence
    # instead of KV), the fourth gated full attention; RMSNorms scale by (1 + weight). The
    # ...ForConditionalGeneration checkpoints are read for their text model only.
    "Qwen3_5ForCausalLM": Architecture("qwen3_5", "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True, hybrid=True),
    "Qwen3_5ForConditionalGeneration": Architecture("qwen3_5", "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True,
                                                    hybrid=True),
    "Qwen3_5MoeForCausalLM": Architecture("qwen3_5_moe", "qwen3_5_moe:Qwen3_5MoeForCausalLM", qk_norm=True,
                                          hybrid=True, moe=True, always_norm_topk=True),
    "Qwen3_5MoeForConditionalGeneration": Architecture("qwen3_5_moe", "qwen3_5_moe:Qwen3_5MoeForCausalLM",
                                                       qk_norm=True, hybrid=True, moe=True, always_norm_topk=True),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds ``architecture`` (a key of ``ARCHITECTURES``)."""
    module, cls = ARCHITECTURES[architecture].model.split(":")
    return getattr(importlib.import_module(f"teacher_server.models.{module}"), cls)
