"""Canonical workloads (docs/design.md, sections 3 and 4), the model shapes they run on, and FLOP
counts for MFU. In the package (not only under bench/) so that ``teacher-server bench`` runs
them from an installed copy; bench/workloads.py re-exports them beside its checkpoint writer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}
QWEN3_32B = dict(QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8)
# Llama-3.3-70B's shape (dummy weights: 140 GB does not fit the GPU machine's disk); TP2.
LLAMA33_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}
# W5: Qwen3-30B-A3B (its config.json's shape; every layer routed, 128 experts, top-8).
QWEN3_30B_A3B = dict(QWEN3_8B, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960)
# W7: Qwen3.5-9B, the defaults of transformers' Qwen3_5TextConfig (tests/test_bench_qwen3_5.py checks
# them against it): 32 layers, every 4th full attention (16 heads of 256, 4 KV heads, an output gate,
# rotary on a quarter of the head), the others Gated DeltaNet (16 key heads and 32 value heads of 128).
# Qwen3-235B-A22B's shape (dummy weights, ~470 GB in bf16: tensor parallel 4 or 8).
QWEN3_235B_A22B = dict(QWEN3_30B_A3B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                       num_attention_heads=64, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=1536)
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)],
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}
# Qwen3.5-35B-A3B's text model: the defaults of transformers' Qwen3_5MoeTextConfig (tests/test_bench_qwen3_5.py
# checks them against it): Qwen3.5's hybrid layers (every 4th full attention) at hidden 2048, 40 layers, each MLP
# 256 experts top-8 of 512 and a gated shared expert of 512; dummy weights (~70 GB in bf16).
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}
# Moonlight-16B-A3B's shape (DeepseekV3ForCausalLM as its config.json; dummy weights): latent attention
# without q low-rank, 64 routed experts top-6 in one group, 2 shared, the first layer dense. No MTP layer
# (transformers' baseline would build one).
MOONLIGHT_16B_A3B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "norm_topk_prob": True, "num_nextn_predict_layers": 0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "attention_bias": False,
}
# DeepSeek-V3's layer shape (hidden 7168, 128 heads, q low-rank 1536, 256 experts top-8 in 8 groups, YaRN x40)
# with as many layers as one H200 holds in bf16: its 3 dense layers and 4 expert layers (22.5 GB each).
DEEPSEEK_V3_LAYERS = dict(
    MOONLIGHT_16B_A3B, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=7, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, routed_scaling_factor=2.5, q_lora_rank=1536, n_group=8, topk_group=4,
    first_k_dense_replace=3, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096})
# gpt-oss-20b's config.json (GptOssForCausalLM; transformers' GptOssConfig defaults but 24 layers and
# 32 experts): attention sinks, 128-token windows on every other layer, 32 experts top-4, YaRN.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "attention_bias": True, "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# Qwen3-Next-80B-A3B's layer shape (Qwen3NextForCausalLM: hidden 2048, 512 experts of 512 top-10 with a
# shared expert, 32 value / 16 key heads of 128 in the linear layers, gated attention every 4th layer)
# at 24 of its 48 layers: all 48 are ~160 GB in bf16, 24 (~80 GB) leave one H200 room for the pool.
QWEN3_NEXT_80B_A3B_LAYERS = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "layer_types": [t for _ in range(6) for t in ("linear_attention",) * 3 + ("full_attention",)],
    "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# Gemma-3-27B's text model (google/gemma-3-27b-it's text_config as published, read as Gemma3ForCausalLM; dummy
# weights, all 62 layers: 54 GB): 5 local layers (1,024-key window, rotary base 1e4) to 1 global (1e6, linear x8).
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "attention_bias": False,
}
# GLM-4.5-Air's layer shape (zai-org/GLM-4.5-Air's config.json: 96 heads of 128, 8 KV heads, q/k/v biases, rotary on
# half the head, 128 experts top-8 of 1408 and one shared, the first layer dense) at 18 of its 46 layers: the whole
# model is 212 GB in bf16; 18 layers (82 GB) leave room for transformers' [rows, vocab] logits beside them.
GLM45_AIR_LAYERS = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 18, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "first_k_dense_replace": 1, "partial_rotary_factor": 0.5, "use_qk_norm": False, "attention_bias": True,
    "num_nextn_predict_layers": 0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
H200_PEAK = 989e12  # dense bf16 FLOP/s


@dataclass
class Req:
    tokens: np.ndarray  # [L] int64
    start: int  # first scored row = len(prompt) - 1
    cand: np.ndarray  # [rows, K] int32, unique per row

    @property
    def rows(self) -> int:
        return len(self.tokens) - 1 - self.start


def _candidates(rng: np.random.Generator, rows: int, k: int, vocab: int) -> np.ndarray:
    # Unique ids per row without a per-row shuffle: a + j * stride (mod vocab), stride * K < vocab.
    a = rng.integers(0, vocab, (rows, 1))
    stride = rng.integers(1, vocab // k, (rows, 1))
    return ((a + np.arange(k)[None, :] * stride) % vocab).astype(np.int32)


NAMES = ("W1", "W1f", "W2", "W3", "W4", "G1")
TINY = ("W1", "W2")


def check_name(name: str) -> None:
    """ValueError naming what is built, for a workload name ``make_workload`` does not take."""
    base, tiny = name.removesuffix(":tiny"), name.endswith(":tiny")
    if tiny and base not in TINY:
        raise ValueError(f"no tiny variant of {base!r}: --tiny takes {', '.join(TINY)}")
    if not tiny and base not in NAMES and not (base[:1] == "L" and base[1:].isdigit() and int(base[1:]) > 1024):
        raise ValueError(f"no workload {base!r}: one of {', '.join(NAMES)}, or L<tokens> (one request of that "
                         f"many tokens, above 1024)")


def make_workload(name: str, vocab: int, k: int = 64, seed: int = 0) -> list[Req]:
    """The requests of workload ``name``; "W1:tiny" and "W2:tiny" are the same shapes scaled
    down (CPU smoke runs of the benchmark)."""
    rng = np.random.default_rng(seed)
    if name.endswith(":tiny"):
        return _tiny_workload(name.removesuffix(":tiny"), vocab, rng)
    if name == "W1":
        n = 128
        prompts = rng.integers(256, 1793, n)
        responses = rng.integers(1024, 5121, n)
    elif name == "W1f":
        prompts, responses = np.full(64, 1024), np.full(64, 3072)
    elif name == "W3":
        prompts, responses = np.full(8, 1024), np.full(8, 31744)
    elif name == "W4":
        prompts, responses = np.full(32, 1024), np.full(32, 3072)
    elif name == "W2":
        out = []
        for _ in range(32):
            prompt = rng.integers(0, vocab, 2048)
            for _ in range(8):
                toks = np.concatenate([prompt, rng.integers(0, vocab, 2048)])
                out.append(Req(toks, 2047, _candidates(rng, 2048, k, vocab)))
        return out
    elif name == "G1":  # GRPO: 32 prompts, 8-16 responses each, all lengths varied
        out = []
        for _ in range(32):
            prompt = rng.integers(0, vocab, int(rng.integers(1024, 2049)))
            for r in rng.integers(512, 4097, int(rng.integers(8, 17))).tolist():
                toks = np.concatenate([prompt, rng.integers(0, vocab, r)])
                out.append(Req(toks, len(prompt) - 1, _candidates(rng, r, k, vocab)))
        return out
    elif name.startswith("L"):  # one long request, e.g. L131072
        total = int(name[1:])
        prompts, responses = np.array([1024]), np.array([total - 1024])
    else:
        raise ValueError(name)
    out = []
    for p, r in zip(prompts.tolist(), responses.tolist()):
        toks = rng.integers(0, vocab, p + r)
        out.append(Req(toks, p - 1, _candidates(rng, r, k, vocab)))
    return out


def _tiny_workload(name: str, vocab: int, rng: np.random.Generator, k: int = 8) -> list[Req]:
    """W1 (8 requests, prompts of 4-28 and responses of 16-80 tokens) or W2 (2 prompts of 48
    tokens with 8 responses of 32 each)."""
    if name == "W1":
        lens = zip(rng.integers(4, 29, 8).tolist(), rng.integers(16, 81, 8).tolist())
        return [Req(rng.integers(0, vocab, p + r), p - 1, _candidates(rng, r, k, vocab)) for p, r in lens]
    if name == "W2":
        out = []
        for _ in range(2):
            prompt = rng.integers(0, vocab, 48)
            out += [Req(np.concatenate([prompt, rng.integers(0, vocab, 32)]), 47, _candidates(rng, 32, k, vocab))
                    for _ in range(8)]
        return out
    raise ValueError(f"no tiny variant of {name}")


def flops(cfg: dict, reqs: list[Req], computed_only: bool = False, cached: list[int] | None = None) -> float:
    """docs/design.md, section 4: 2 x non-embedding params + 2 x layers x context x attn_dim per token
    (causal average) + 2 x hidden x vocab per scored row. For MoE models the params are the
    active ones (the experts a token is routed to), as MFU counts them. Hybrid models (Qwen3.5)
    count their linear-attention layers by their parameters and attention only in the
    full-attention layers. Sliding-window layers (Gemma 3's local ones) count the keys they
    attend to: at most their window."""
    h, n_l = cfg["hidden_size"], cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):  # latent attention: q.k over qk_nope + qk_rope, p.v over v_head_dim
        q = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) / 2
    else:
        q = cfg["num_attention_heads"] * cfg["head_dim"]
    if cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("layer_types"):
        from teacher_server.models.spec import ModelSpec

        spec = ModelSpec.from_dict(cfg)
        params, attn_layers = spec.non_embedding_params(), len(spec.kv_layer_ids)
    else:
        i, kv = cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
        params, attn_layers = n_l * (h * (q + 2 * kv) + q * h + 3 * h * i), n_l
    windows: list[int | None] = [None] * attn_layers
    if cfg.get("sliding_window"):
        from teacher_server.models.spec import ModelSpec

        spec = ModelSpec.from_dict(cfg)
        windows = [spec.layer_window(i) for i in spec.kv_layer_ids]
    total = 0.0
    for j, r in enumerate(reqs):
        length = len(r.tokens)
        skip = cached[j] if (computed_only and cached) else 0
        n = length - skip
        pairs = sum(length * length - skip * skip if w is None
                    else 2 * (_window_pairs(length, w) - _window_pairs(skip, w)) for w in windows)
        total += 2 * params * n + 2 * q * pairs + 2 * h * cfg["vocab_size"] * r.rows
    return total


def _window_pairs(n: int, w: int) -> float:
    """(query, key) pairs of the first n positions under a window of w keys, in the units of
    the causal count n * n / 2."""
    return n * n / 2 if n <= w else w * w / 2 + (n - w) * w


def ideal_cached(reqs: list[Req], block: int) -> list[int]:
    """Tokens of each request a prefix cache could skip at best, in this order: the longest
    prefix it shares with an earlier request, cut to whole blocks that end before its first
    scored row (that row's position is computed)."""
    out = []
    for j, r in enumerate(reqs):
        best = 0
        for e in reqs[:j]:
            n = min(len(e.tokens), len(r.tokens), r.start)
            diff = np.flatnonzero(e.tokens[:n] != r.tokens[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        out.append(best // block * block)
    return out


def flop_ideal_speedup(cfg: dict, reqs: list[Req], block: int) -> float:
    """The prefix cache's speedup if time were proportional to FLOPs: all of them over those
    left after the best reuse (``ideal_cached``)."""
    return flops(cfg, reqs) / flops(cfg, reqs, computed_only=True, cached=ideal_cached(reqs, block))


def tiny(cfg: dict) -> dict:
    """A small model of ``cfg``'s family and layer pattern (its first four layers), for smoke
    runs of a benchmark's path on the CPU."""
    small = dict(cfg, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    if cfg.get("layer_types"):
        small |= {"layer_types": cfg["layer_types"][:4], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    if cfg.get("num_experts"):
        small |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    if cfg.get("num_local_experts"):  # gpt-oss (experts of intermediate_size)
        small |= {"num_local_experts": 8, "num_experts_per_tok": 2}
    if cfg.get("kv_lora_rank"):  # DeepSeek: its latent widths and expert groups, smaller
        small |= {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "kv_lora_rank": 64,
                  "q_lora_rank": cfg["q_lora_rank"] and 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                  "v_head_dim": 32, "num_key_value_heads": 4, "n_group": min(cfg["n_group"], 4),
                  "topk_group": min(cfg["topk_group"], 2), "first_k_dense_replace": 1}
        small.pop("head_dim")
    elif cfg.get("n_routed_experts"):  # GLM-4.5: DeepSeek's routing over fewer, narrower experts
        small |= {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "first_k_dense_replace": 1}
    return small


def with_layers(cfg: dict, n: int) -> dict:
    """``cfg`` at its first ``n`` layers (the layer-kind pattern cut alike): a shape's depth reduced
    to fit a smaller GPU, per-layer rates unchanged."""
    assert 0 < n <= cfg["num_hidden_layers"], f"{n} layers of {cfg['num_hidden_layers']}"
    out = dict(cfg, num_hidden_layers=n)
    if cfg.get("layer_types"):
        out["layer_types"] = cfg["layer_types"][:n]
    return out


def checkpoint_bytes(cfg: dict) -> int:
    """bf16 bytes of a checkpoint of shape ``cfg``, every expert counted."""
    from teacher_server.models.spec import ModelSpec

    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    every = dict(cfg, num_experts_per_tok=experts, topk_group=cfg.get("n_group")) if experts else cfg
    embed = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2)
    return 2 * (ModelSpec.from_dict(every).non_embedding_params() + embed)
