"""Tiny random DeepSeek-V2/V3 checkpoints (and Kimi-K2's and Moonlight's spellings of the V3
config) written from transformers' own models, and their float32 transformers reference
registered for ``reference.reference_scores``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from reference import _MODELS, ROUTER, randomize_weights
from safetensors.torch import load_file, save_file

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
              kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
# name -> (V3 or V2, config keys). "v3": q low-rank, 4 groups of 2 experts, top-2 groups, YaRN;
# "v3_noq": no q low-rank, one group (Moonlight's routing), plain rope; "kimi": Kimi-K2's
# spelling (model_type kimi_k2, old-style rope_scaling, its routing keys, one group);
# "v3_halfrope": rope_interleave false; "v2": softmax, group-limited greedy, q low-rank;
# "v2lite": greedy, no q low-rank (DeepSeek-V2-Lite).
CONFIGS: dict[str, tuple[str, dict]] = {
    "v3": ("v3", dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                      n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN)),
    "v3_noq": ("v3", dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                          n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "v3_halfrope": ("v3", dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                               n_shared_experts=1, routed_scaling_factor=1.0, rope_interleave=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "kimi": ("v3", dict(q_lora_rank=48, n_routed_experts=12, num_experts_per_tok=4, n_group=1, topk_group=1,
                        n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True,
                        rope_parameters={**YARN, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0})),
    "v2": ("v2", dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
                      n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=1.5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "v2lite": ("v2", dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                          n_shared_experts=2, routed_scaling_factor=1.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# GPU-sized: DeepSeek's own head widths (q/k 192, v 128, latent 512 + 64), so the fast
# attention backends run at the shapes they will serve.
GPU_CONFIGS: dict[str, tuple[str, dict]] = {
    "v3_gpu": ("v3", dict(hidden_size=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, q_lora_rank=96, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                          topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                          rope_parameters=YARN)),
    "v2lite_gpu": ("v2", dict(hidden_size=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, q_lora_rank=None, n_routed_experts=16, num_experts_per_tok=4,
                              topk_method="greedy", n_shared_experts=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def make_deepseek_checkpoint(name: str, path: Path, seed: int = 0, mtp: bool = True) -> Path:
    """Save tiny random ``name`` (a key of CONFIGS or GPU_CONFIGS) to ``path``; with ``mtp`` a fake
    multi-token-prediction layer's tensors are written after the last layer (to be skipped)."""
    import transformers as tf

    kind, keys = {**CONFIGS, **GPU_CONFIGS}[name]
    if kind == "v3":
        cfg, cls = tf.DeepseekV3Config(**{**COMMON, **keys}), tf.DeepseekV3ForCausalLM
    else:
        cfg, cls = tf.DeepseekV2Config(**{**COMMON, **keys}), tf.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    randomize_weights(model, (ROUTER,))
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # picks, never weighs: make it change the picks
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    if mtp:  # DeepSeek-V3's hub layout: the MTP layer is model.layers.<num_hidden_layers>
        d["num_nextn_predict_layers"] = 1
        f = path / "model.safetensors"
        tensors = load_file(str(f))
        last = COMMON["num_hidden_layers"]
        tensors.update({f"model.layers.{last}.eh_proj.weight": torch.randn(64, 128),
                        f"model.layers.{last}.self_attn.kv_b_proj.weight": torch.randn(8, 8)})
        save_file(tensors, str(f), metadata={"format": "pt"})
    if name == "kimi":  # Kimi-K2's config.json: its model type, old-style rope keys, its routing keys
        rp = d.pop("rope_parameters")
        d.update(model_type="kimi_k2", rope_theta=rp.pop("rope_theta"), topk_method="noaux_tc",
                 scoring_func="sigmoid", moe_layer_freq=1, aux_loss_alpha=0.001, seq_aux=True,
                 auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
                 rope_scaling={**{k: v for k, v in rp.items() if k != "rope_type"}, "type": "yarn"})
    cfg_path.write_text(json.dumps(d))
    _MODELS[f"{path}:{torch.float32}"] = model  # the reference, as built (Kimi's config.json is not transformers')
    return path
