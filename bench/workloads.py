"""Canonical workloads (docs/design.md, section 3), model shapes, FLOP counts, and the random
checkpoints the benchmarks load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    full-attention layers."""
    h, n_l = cfg["hidden_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    if cfg.get("num_experts") or cfg.get("layer_types"):
        from teacher_server.models.spec import ModelSpec

        spec = ModelSpec.from_dict(cfg)
        params, attn_layers = spec.non_embedding_params(), len(spec.kv_layer_ids)
    else:
        i, kv = cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
        params, attn_layers = n_l * (h * (q + 2 * kv) + q * h + 3 * h * i), n_l
    total = 0.0
    for j, r in enumerate(reqs):
        length = len(r.tokens)
        skip = cached[j] if (computed_only and cached) else 0
        n = length - skip
        total += 2 * params * n + 2 * attn_layers * q * (length * length - skip * skip) + 2 * h * cfg["vocab_size"] * r.rows
    return total


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


def write_config(path: Path, cfg: dict) -> Path:
    """``config.json`` of ``cfg``, rewritten only when it differs, by rename (a baseline process
    may be reading it)."""
    path.mkdir(parents=True, exist_ok=True)
    text, f = json.dumps(cfg, indent=1), path / "config.json"
    if not f.exists() or f.read_text() != text:
        tmp = f.with_suffix(".json.part")
        tmp.write_text(text)
        tmp.replace(f)
    return path


def write_random_checkpoint(path: Path, cfg: dict, seed: int = 0, shard_gb: float = 4.0) -> Path:
    """Random bf16 weights with HF names, made on the GPU (CPU when there is none), saved as
    sharded safetensors; kept when already there."""
    import torch
    from safetensors.torch import save_file

    write_config(path, cfg)
    if (path / "model.safetensors.index.json").exists():
        return path
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)

    def one(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=torch.bfloat16, device=dev)

    def zero(*shape: int) -> torch.Tensor:  # a (1 + weight) norm's unit scale
        return torch.zeros(*shape, dtype=torch.bfloat16, device=dev)

    def conv_w(*shape: int) -> torch.Tensor:  # the linear layers' short convolution: taps of order 1
        return (torch.randn(*shape, generator=g, device=dev) * 0.5).to(torch.bfloat16)

    def a_log(n: int) -> torch.Tensor:  # decay rates A in [0.005, 0.1]: the state is kept for ~10-200 tokens
        return (torch.rand(n, generator=g, device=dev) * 0.095 + 0.005).log().to(torch.bfloat16)

    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    hybrid = "linear_attention" in types
    unit = zero if hybrid else one  # Qwen3.5's decoder norms scale by (1 + weight)
    names: dict[str, tuple] = {"model.embed_tokens.weight": (w, (v, h)), "model.norm.weight": (unit, (h,)),
                               "lm_head.weight": (w, (v, h))}
    for layer, kind in enumerate(types):
        p = f"model.layers.{layer}."
        names |= {p + "input_layernorm.weight": (unit, (h,)), p + "post_attention_layernorm.weight": (unit, (h,)),
                  p + "mlp.gate_proj.weight": (w, (inter, h)), p + "mlp.up_proj.weight": (w, (inter, h)),
                  p + "mlp.down_proj.weight": (w, (h, inter))}
        if kind == "linear_attention":
            nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            conv = 2 * nk * dk + nv * dv
            la = p + "linear_attn."
            names |= {la + "in_proj_qkv.weight": (w, (conv, h)), la + "in_proj_z.weight": (w, (nv * dv, h)),
                      la + "in_proj_b.weight": (w, (nv, h)), la + "in_proj_a.weight": (w, (nv, h)),
                      la + "conv1d.weight": (conv_w, (conv, 1, cfg["linear_conv_kernel_dim"])),
                      la + "dt_bias": (one, (nv,)), la + "A_log": (a_log, (nv,)), la + "norm.weight": (one, (dv,)),
                      la + "out_proj.weight": (w, (h, nv * dv))}
        else:
            gate = 2 if hybrid else 1  # Qwen3.5's q_proj also makes the output gate
            names |= {p + "self_attn.q_proj.weight": (w, (gate * q, h)), p + "self_attn.k_proj.weight": (w, (kv, h)),
                      p + "self_attn.v_proj.weight": (w, (kv, h)), p + "self_attn.o_proj.weight": (w, (h, q)),
                      p + "self_attn.q_norm.weight": (unit, (d,)), p + "self_attn.k_norm.weight": (unit, (d,))}
    shard: dict = {}
    size, idx, weight_map = 0, 0, {}
    files = []

    def flush() -> None:
        nonlocal shard, size, idx
        if shard:
            fname = f"model-{idx:05d}.safetensors"
            save_file({k: t.cpu() for k, t in shard.items()}, str(path / fname), metadata={"format": "pt"})
            for k in shard:
                weight_map[k] = fname
            files.append(fname)
            shard, size, idx = {}, 0, idx + 1

    for name, (fn, shape) in names.items():
        t = fn(*shape)
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_gb * 1e9:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
