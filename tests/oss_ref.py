"""Tiny random gpt-oss and Qwen3-Next checkpoints written from transformers' own models, and
their float32 transformers reference registered for ``reference.reference_scores``.

gpt-oss: windows of 8 tokens (the test sequences run to 150), sinks, router logits and expert
weights drawn large (the clamped SwiGLU's limits are reached; routing far from ties); "mxfp4"
writes the expert weights MXFP4-packed (``layers.formats.mxfp4.quantize``) and its reference
holds the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from reference import _MODELS, ROUTER, randomize_weights
from safetensors.torch import load_file, save_file

from teacher_server.layers.formats.mxfp4 import dequantize, quantize

GPT_OSS = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
               max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
OSS_RULES = (
    # router logits of a few units, not tens: the routing weights (a softmax over the top-k logits)
    # multiply the experts' large clamped outputs, so float32 noise in logits of ~65 moved the scores
    # by 3e-4 on the CPU and 1.5e-3 on an H200 (this scale: 2e-5 on the CPU); still far from ties
    ("mlp.router.weight", lambda n, p: 0.15 * torch.randn_like(p)),
    ("self_attn.sinks", lambda n, p: torch.randn_like(p)),  # sinks that take a real share of each softmax
    ("experts.gate_up_proj", lambda n, p: 0.6 * torch.randn_like(p)),  # gate/up past the clamp limit of 7
    ROUTER,
)
# GPU-sized: gpt-oss's own head width (64) and window (128), so the fast backends run at its shapes.
GPT_OSS_GPU = dict(GPT_OSS, hidden_size=256, intermediate_size=256, num_attention_heads=8, head_dim=64,
                   sliding_window=128)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def make_gpt_oss_checkpoint(name: str, path: Path, seed: int = 0, vocab: int = 512, gpu: bool = False,
                            **overrides: object) -> Path:
    """``name``: "plain" (transformers' save) or "mxfp4" (experts packed as the hub ships them);
    ``gpu``: the GPU-sized shape; ``overrides``: config keys."""
    import transformers as tf

    cfg = tf.GptOssConfig(**{**(GPT_OSS_GPU if gpu else GPT_OSS), "vocab_size": vocab, **overrides})
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(cfg).to(torch.float32).eval()
    randomize_weights(model, OSS_RULES)
    if name == "plain":
        model.save_pretrained(path, safe_serialization=True)
        return path
    packed = {}
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            ex = block.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(ex, proj)  # [E, in, out]
                n = p.shape[1]  # (in a multiple of 32 for the packing: the last block zero-padded, as exporters do)
                w = torch.nn.functional.pad(p.transpose(1, 2), (0, -n % 32))
                blocks, scales = quantize(w)  # [E, out, in / 32, 16], [E, out, in / 32]
                p.copy_(dequantize(blocks, scales)[..., :n].transpose(1, 2))  # the reference holds what the file says
                packed[f"model.layers.{layer}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{layer}.mlp.experts.{proj}_scales"] = scales
    model.save_pretrained(path, safe_serialization=True)
    f = path / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(f)).items() if not k.endswith(("experts.gate_up_proj",
                                                                               "experts.down_proj"))}
    save_file({**tensors, **packed}, str(f), metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(d))
    _MODELS[f"{path}:{torch.float32}"] = model  # transformers' MXFP4 loader wants GPU kernels
    return path


def make_qwen3_next_checkpoint(path: Path, seed: int = 0, gpu: bool = False) -> Path:
    """A tiny random Qwen3-Next: 4 layers (3 Gated DeltaNet, the 4th gated full attention),
    2 key heads serving 4 value heads (the grouped in-projections take apart unevenly), 8
    experts top-3 and the gated shared expert on layers 0, 1 and 3, layer 2 dense
    (``mlp_only_layers``), top-k weights not renormalised; the linear layers' decay and
    convolution drawn as ``reference.make_hybrid_checkpoint`` does. ``gpu``: head widths of 128
    (the fast kernels' shapes)."""
    import transformers as tf

    full, lin = "full_attention", "linear_attention"
    cfg = tf.Qwen3NextConfig(vocab_size=512, hidden_size=256 if gpu else 64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=128 if gpu else 16, max_position_embeddings=8192,
                             rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=128 if gpu else 16,
                             linear_value_head_dim=128 if gpu else 8, num_hidden_layers=4, layer_types=[lin, lin, lin, full],
                             intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[2],
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    model = tf.Qwen3NextForCausalLM(cfg).to(torch.float32).eval()
    randomize_weights(model, (
        ("A_log", lambda n, p: torch.empty_like(p).uniform_(0.005, 0.1).log()),
        ("dt_bias", lambda n, p: 0.5 * torch.randn_like(p)),
        ("conv1d.weight", lambda n, p: 0.5 * torch.randn_like(p)),
        ("linear_attn.norm.weight", lambda n, p: 1.0 + 0.2 * torch.randn_like(p)),
        ("norm.weight", lambda n, p: 0.2 * torch.randn_like(p)),  # zero-centred: (1 + weight)
        ROUTER,
    ))
    model.save_pretrained(path, safe_serialization=True)
    return path
