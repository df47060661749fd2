"""The built-in demo model: a small Qwen3-architecture checkpoint with RANDOM weights,
written once (config.json + safetensors) and then served through the normal loader."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

DEMO_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "teacher_server_demo": "random weights, for trying the service only",
}
DEMO_VERSION = "1"


def default_demo_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "teacher-server" / f"demo-qwen3-v{DEMO_VERSION}"


def demo_weights(cfg: dict, seed: int = 1234) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    out = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": norm(h),
           "lm_head.weight": w(v, h, std=0.2)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
        }
    return out


def ensure_demo_model(path: str | os.PathLike | None = None) -> Path:
    """Write the demo checkpoint if it is not there yet; return its directory."""
    target = Path(path) if path else default_demo_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        save_file(demo_weights(DEMO_CONFIG), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
        try:
            tmp.rename(target)  # atomic: concurrent starters never see half a checkpoint
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
