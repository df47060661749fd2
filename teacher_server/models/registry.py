"""Supported ``architectures`` of config.json: each names its family, the class that builds
it (imported on first use) and the family facts config.json leaves implicit. A new
family is one file in this package and one line here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    layer_sliding: bool = False  # use_sliding_window makes layers slide one by one (layer_types, max_window_layers)
    moe: bool = False  # routed experts (num_experts, num_experts_per_tok, ... in config.json)
    always_norm_topk: bool = False  # top-k weights renormalised whatever config.json says (Mixtral)
    hybrid: bool = False  # Gated DeltaNet linear-attention layers among gated full-attention ones (Qwen3.5)
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers make some layers dense (Qwen2/3-MoE)
    deepseek: bool = False  # latent attention and DeepSeekMoE (``deepseek_spec`` reads their keys)
    # What a key config.json leaves out is: the default of the family's transformers config
    # class (keys whose default is derived, such as head_dim or num_key_value_heads, are not here).
    defaults: dict[str, Any] = field(default_factory=dict)


def _defaults(vocab: int, hidden: int, inter: int | None, layers: int, heads: int, max_pos: int,
              **more: Any) -> dict[str, Any]:
    d = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
             num_attention_heads=heads, max_position_embeddings=max_pos, rms_norm_eps=1e-6, rope_theta=10000.0)
    return {k: v for k, v in {**d, **more}.items() if v is not None}


LLAMA = _defaults(32000, 4096, 11008, 32, 32, 2048)
MISTRAL = _defaults(32000, 4096, 14336, 32, 32, 131072, num_key_value_heads=8, sliding_window=4096)
QWEN2 = _defaults(151936, 4096, 22016, 32, 32, 32768, num_key_value_heads=32)
QWEN3 = _defaults(151936, 4096, 22016, 32, 32, 32768, num_key_value_heads=32, head_dim=128)
QWEN3_MOE = _defaults(151936, 2048, 6144, 24, 32, 32768, num_key_value_heads=4, num_local_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768)
QWEN2_MOE = _defaults(151936, 2048, 5632, 24, 16, 32768, num_key_value_heads=16, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
MIXTRAL = _defaults(32000, 4096, 14336, 32, 32, 131072, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6)
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4)  # Qwen3.5's Gated DeltaNet layers
QWEN3_5 = _defaults(248320, 4096, 12288, 32, 16, 32768, num_key_value_heads=4, head_dim=256, **LINEAR)
QWEN3_5_MOE = _defaults(248320, 2048, None, 40, 16, 32768, num_key_value_heads=2, head_dim=256, num_experts=256,
                        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                        **LINEAR)
# DeepSeek: transformers' DeepseekV3Config / DeepseekV2Config defaults (q_lora_rank null in a file: none).
_MLA = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V3 = _defaults(129280, 7168, 18432, 61, 128, 4096, moe_intermediate_size=2048, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True, **_MLA)
DEEPSEEK_V2 = _defaults(102400, 4096, 11008, 32, 32, 2048, moe_intermediate_size=1407, n_shared_experts=2,
                        n_routed_experts=64, routed_scaling_factor=1.0, first_k_dense_replace=0, topk_method="greedy",
                        norm_topk_prob=False, **_MLA)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama:LlamaForCausalLM", defaults=LLAMA),
    "MistralForCausalLM": Architecture("mistral", "llama:LlamaForCausalLM", sliding_window=True, defaults=MISTRAL),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama:LlamaForCausalLM", attention_bias=True, layer_sliding=True,
                                     defaults=QWEN2),
    "Qwen3ForCausalLM": Architecture("qwen3", "qwen3:Qwen3ForCausalLM", qk_norm=True, layer_sliding=True,
                                     defaults=QWEN3),
    # Mixture-of-experts families (layers/moe.py holds the expert layer).
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "qwen3_moe:Qwen3MoeForCausalLM", qk_norm=True,
                                        refuse_sliding_window=True, moe=True, sparse_step=True, defaults=QWEN3_MOE),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", "qwen2_moe:Qwen2MoeForCausalLM", attention_bias=True,
                                        refuse_sliding_window=True, moe=True, sparse_step=True, defaults=QWEN2_MOE),
    "MixtralForCausalLM": Architecture("mixtral", "mixtral:MixtralForCausalLM", sliding_window=True, moe=True,
                                       always_norm_topk=True, defaults=MIXTRAL),
    # Hybrid families: three of four layers are Gated DeltaNet (a recurrent state per sequence
    # instead of KV), the fourth gated full attention; RMSNorms scale by (1 + weight). The
    # ...ForConditionalGeneration checkpoints are read for their text model only.
    "Qwen3_5ForCausalLM": Architecture("qwen3_5", "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True, hybrid=True,
                                       defaults=QWEN3_5),
    "Qwen3_5ForConditionalGeneration": Architecture("qwen3_5", "qwen3_5:Qwen3_5ForCausalLM", qk_norm=True,
                                                    hybrid=True, defaults=QWEN3_5),
    "Qwen3_5MoeForCausalLM": Architecture("qwen3_5_moe", "qwen3_5_moe:Qwen3_5MoeForCausalLM", qk_norm=True,
                                          hybrid=True, moe=True, always_norm_topk=True, defaults=QWEN3_5_MOE),
    "Qwen3_5MoeForConditionalGeneration": Architecture("qwen3_5_moe", "qwen3_5_moe:Qwen3_5MoeForCausalLM",
                                                       qk_norm=True, hybrid=True, moe=True, always_norm_topk=True,
                                                       defaults=QWEN3_5_MOE),
    # Multi-head latent attention and DeepSeekMoE (Kimi-K2 and Moonlight are DeepseekV3ForCausalLM).
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3", "deepseek:DeepseekForCausalLM", deepseek=True,
                                          defaults=DEEPSEEK_V3),
    "DeepseekV2ForCausalLM": Architecture("deepseek_v2", "deepseek:DeepseekForCausalLM", deepseek=True,
                                          defaults=DEEPSEEK_V2),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds ``architecture`` (a key of ``ARCHITECTURES``)."""
    module, cls = ARCHITECTURES[architecture].model.split(":")
    return getattr(importlib.import_module(f"teacher_server.models.{module}"), cls)
