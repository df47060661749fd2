"""Tiny random Gemma 3 and GLM-4.5 checkpoints written from transformers' own models (their
float32 forward is the reference of ``reference.reference_scores``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from reference import _MODELS, ROUTER, randomize_weights
from safetensors.torch import load_file, save_file

S, F = "sliding_attention", "full_attention"
GEMMA_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-6,
                    query_pre_attn_scalar=24, sliding_window=12)
# name -> config keys. "gemma3": the released 5:1 pattern cut to 6 layers (window 12, so the
# test sequences of up to 150 tokens slide), linear rope scaling on the global layer;
# "gemma3_capped": a logit soft-cap and a local layer last; "gemma3_vl": the vision-language
# checkpoint (a tiny vision tower the server skips); "gemma3_hd128": GPU-sized heads.
GEMMA: dict[str, dict] = {
    "gemma3": dict(num_hidden_layers=6, rope_parameters={F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                         S: {"rope_type": "default", "rope_theta": 10000.0}}),
    "gemma3_capped": dict(num_hidden_layers=3, layer_types=[S, F, S], final_logit_softcapping=3.0,
                          rope_parameters={F: {"rope_type": "default", "rope_theta": 50000.0},
                                           S: {"rope_type": "default", "rope_theta": 1000.0}}),
    "gemma3_vl": dict(num_hidden_layers=2, layer_types=[S, F]),
    "gemma3_hd128": dict(hidden_size=256, intermediate_size=512, head_dim=128, num_hidden_layers=6,
                         sliding_window=300, query_pre_attn_scalar=128),
}
GLM_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, first_k_dense_replace=1)
# "glm": GLM-4.5's kind (q/k norm, 2 groups, scaling 2.5); "glm_air": GLM-4.5-Air's (no q/k
# norm, one group, scaling 1); "glm_hd128": GPU-sized heads.
GLM: dict[str, dict] = {
    "glm": dict(attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "glm_air": dict(attention_bias=True, use_qk_norm=False, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                    topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    "glm_hd128": dict(hidden_size=256, head_dim=128, attention_bias=True, use_qk_norm=True, n_routed_experts=16,
                      num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
}


def make_gemma3_checkpoint(name: str, path: Path, seed: int = 0, vocab: int = 512) -> Path:
    """Save tiny random Gemma 3 ``name`` (a key of GEMMA) to ``path``."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(**{**GEMMA_COMMON, "vocab_size": vocab, **GEMMA[name]})
    cls = tf.Gemma3ForCausalLM
    if name == "gemma3_vl":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        cfg = tf.Gemma3Config(text_config=cfg.to_dict(), vision_config=vision, mm_tokens_per_image=4)
        cls = tf.Gemma3ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    # every norm scales by (1 + w): w around 0
    randomize_weights(model, (("norm.weight", lambda n, p: 0.2 * torch.randn_like(p)),))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_glm_checkpoint(name: str, path: Path, seed: int = 0, mtp: bool = True) -> Path:
    """Save tiny random GLM-4.5 ``name`` (a key of GLM) to ``path``; with ``mtp`` a fake
    multi-token-prediction layer after the last one (to be skipped), as the hub's checkpoints."""
    import transformers as tf

    cfg = tf.Glm4MoeConfig(**{**GLM_COMMON, **GLM[name]})
    torch.manual_seed(seed)
    model = tf.Glm4MoeForCausalLM(cfg).to(torch.float32).eval()
    randomize_weights(model, (ROUTER,))
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # picks, never weighs: make it change the picks
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    if mtp:
        d = json.loads((path / "config.json").read_text())
        d["num_nextn_predict_layers"] = 1
        (path / "config.json").write_text(json.dumps(d))
        f = path / "model.safetensors"
        tensors = load_file(str(f))
        last = cfg.num_hidden_layers
        tensors.update({f"model.layers.{last}.eh_proj.weight": torch.randn(64, 128),
                        f"model.layers.{last}.self_attn.q_proj.weight": torch.randn(8, 8)})
        save_file(tensors, str(f), metadata={"format": "pt"})
    _MODELS[f"{path}:{torch.float32}"] = model
    return path
