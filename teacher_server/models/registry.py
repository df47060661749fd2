"""Supported ``architectures`` of config.json: each names its family, the class that builds
it (imported on first use) and the family facts config.json leaves implicit. A new
family is one file in this package and one line here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from teacher_server.models.config_fields import check_fields

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
    gpt_oss: bool = False  # attention sinks, alternating windows, clamped SwiGLU experts (``gpt_oss_spec``)
    gemma3: bool = False  # local/global layers, two rotary bases, GELU-tanh, (1 + w) norms (``gemma3_spec``)
    glm4_moe: bool = False  # DeepSeekMoE routing, partial rotary, optional q/k norm (``glm4_moe_spec``)
    # What a key config.json leaves out is: the default of the family's transformers config
    # class (keys whose default is derived, such as head_dim or num_key_value_heads, are not here).
    defaults: dict[str, Any] = field(default_factory=dict)

    def with_defaults(self, d: dict[str, Any]) -> dict[str, Any]:
        """config.json's keys over the family's defaults. A file that sets its rope (either
        spelling) keeps it whole: no default key is merged under it (gpt-oss's default YaRN
        carries truncate=false; a file's YaRN that leaves truncate out takes transformers' true).
        Its numbers are checked by name (``config_fields``)."""
        rope = ("rope_scaling", "rope_parameters") if d.get("rope_scaling") or d.get("rope_parameters") else ()
        return check_fields({**{k: v for k, v in self.defaults.items() if k not in rope}, **d})


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
# Qwen3-Next: transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B's shape).
QWEN3_NEXT = _defaults(151936, 2048, 5632, 48, 16, 32768, num_key_value_heads=2, head_dim=256, num_experts=512,
                       num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       norm_topk_prob=True, **LINEAR)
# DeepSeek: transformers' DeepseekV3Config / DeepseekV2Config defaults (q_lora_rank null in a file: none).
_MLA = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V3 = _defaults(129280, 7168, 18432, 61, 128, 4096, moe_intermediate_size=2048, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True, **_MLA)
DEEPSEEK_V2 = _defaults(102400, 4096, 11008, 32, 32, 2048, moe_intermediate_size=1407, n_shared_experts=2,
                        n_routed_experts=64, routed_scaling_factor=1.0, first_k_dense_replace=0, topk_method="greedy",
                        norm_topk_prob=False, **_MLA)
# gpt-oss: transformers' GptOssConfig defaults (gpt-oss-120b's depth and experts; -20b's config
# says 24 layers and 32 experts), its YaRN rotary included.
GPT_OSS = _defaults(201088, 2880, 2880, 36, 64, 131072, num_key_value_heads=8, head_dim=64, num_local_experts=128,
                    num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000.0,
                    attention_bias=True, rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 4096})
# Gemma 3: transformers' Gemma3TextConfig defaults (Gemma-3-4B's text model); Glm4MoeConfig's (GLM-4.5-Air).
GEMMA3 = _defaults(262208, 2304, 9216, 26, 8, 131072, num_key_value_heads=4, head_dim=256, rope_theta=1e6,
                   sliding_window=4096, query_pre_attn_scalar=256, rope_local_base_freq=10000.0,
                   tie_word_embeddings=True)
GLM4_MOE = _defaults(151552, 4096, 10944, 46, 96, 131072, num_key_value_heads=8, rms_norm_eps=1e-5,
                     attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
                     n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                     first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, partial_rotary_factor=0.5)


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
    # Qwen3.5-MoE's hybrid layers with grouped in-projections; its router and dense layers as config.json says.
    "Qwen3NextForCausalLM": Architecture("qwen3_next", "qwen3_next:Qwen3NextForCausalLM", qk_norm=True, hybrid=True,
                                         moe=True, sparse_step=True, defaults=QWEN3_NEXT),
    # Multi-head latent attention and DeepSeekMoE (Kimi-K2 and Moonlight are DeepseekV3ForCausalLM).
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3", "deepseek:DeepseekForCausalLM", deepseek=True,
                                          defaults=DEEPSEEK_V3),
    "DeepseekV2ForCausalLM": Architecture("deepseek_v2", "deepseek:DeepseekForCausalLM", deepseek=True,
                                          defaults=DEEPSEEK_V2),
    # Attention sinks, 128-token windows every other layer, biased experts (MXFP4 in the hub checkpoints).
    "GptOssForCausalLM": Architecture("gpt_oss", "gpt_oss:GptOssForCausalLM", attention_bias=True,
                                      sliding_window=True, moe=True, always_norm_topk=True, gpt_oss=True,
                                      defaults=GPT_OSS),
    # Gemma 3's text model (of Gemma3ForConditionalGeneration: its language_model weights, no vision tower).
    "Gemma3ForCausalLM": Architecture("gemma3", "gemma3:Gemma3ForCausalLM", qk_norm=True, sliding_window=True,
                                      gemma3=True, defaults=GEMMA3),
    "Gemma3ForConditionalGeneration": Architecture("gemma3", "gemma3:Gemma3ForCausalLM", qk_norm=True,
                                                   sliding_window=True, gemma3=True, defaults=GEMMA3),
    # GLM-4.5/4.6 and GLM-4.5-Air: DeepSeek-V3's router and shared expert, q/k/v biases (attention_bias).
    "Glm4MoeForCausalLM": Architecture("glm4_moe", "glm4_moe:Glm4MoeForCausalLM", attention_bias=True,
                                       glm4_moe=True, defaults=GLM4_MOE),
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds ``architecture`` (a key of ``ARCHITECTURES``)."""
    module, cls = ARCHITECTURES[architecture].model.split(":")
    return getattr(importlib.import_module(f"teacher_server.models.{module}"), cls)
