"""Load an HF checkpoint directory (config.json + safetensors, sharded or not, with or
without an index file) into DecoderModel, fusing QKV and gate/up; or make random
weights in place (``dummy`` load format)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from teacher_server.model.decoder import DecoderModel
from teacher_server.model.spec import ModelSpec

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name (inside a layer) -> (our parameter, slot in a fused tensor or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "self_attn.q_proj.weight": ("qkv_proj", 0),
    "self_attn.k_proj.weight": ("qkv_proj", 1),
    "self_attn.v_proj.weight": ("qkv_proj", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o_proj", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "mlp.gate_proj.weight": ("gate_up_proj", 0),
    "mlp.up_proj.weight": ("gate_up_proj", 1),
    "mlp.down_proj.weight": ("down_proj", None),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _fused_slices(spec: ModelSpec, name: str) -> list[tuple[int, int]]:
    if name in ("qkv_proj", "qkv_bias"):
        q, kv = spec.q_size, spec.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = spec.intermediate_size
    return [(0, i), (i, 2 * i)]


def load_model(path: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0) -> DecoderModel:
    path = Path(path)
    if load_format == "dummy":
        model = DecoderModel(spec, dtype, device, tied=bool(spec.tie_word_embeddings))
        _init_dummy(model, seed)
        return model
    files = checkpoint_files(path)
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    tied = spec.tie_word_embeddings is True or "lm_head.weight" not in names
    model = DecoderModel(spec, dtype, device, tied=tied)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}  # our param name -> count of parts written
    dev = "cpu" if device.type == "cpu" else str(device)
    for f in files:
        with safe_open(str(f), framework="pt", device=dev) as sf:
            for hf_name in sf.keys():
                target, slot = _map_name(hf_name, tied)
                if target is None:
                    continue
                if target not in params:
                    raise ValueError(f"checkpoint tensor {hf_name} has no place in {spec.architecture} "
                                     f"(config/weights mismatch)")
                t = sf.get_tensor(hf_name)
                p = params[target]
                if slot is None:
                    _copy_checked(p.data, t, hf_name)
                else:
                    lo, hi = _fused_slices(spec, target.rsplit(".", 1)[-1])[slot]
                    _copy_checked(p.data[lo:hi], t, hf_name)
                filled[target] = filled.get(target, 0) + 1
    missing = []
    for name, _ in model.named_parameters():
        short = name.rsplit(".", 1)[-1]
        want = len(_fused_slices(spec, short)) if short in ("qkv_proj", "qkv_bias", "gate_up_proj") else 1
        if filled.get(name, 0) != want:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint {path} is missing weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    return model


def _map_name(hf_name: str, tied: bool) -> tuple[str | None, int | None]:
    if _IGNORED.search(hf_name):
        return None, None
    if hf_name == "model.embed_tokens.weight":
        return "embed", None
    if hf_name == "model.norm.weight":
        return "norm", None
    if hf_name == "lm_head.weight":
        return (None, None) if tied else ("lm_head", None)
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_MAP:
        target, slot = _LAYER_MAP[m.group(2)]
        return f"layers.{m.group(1)}.{target}", slot
    raise ValueError(f"unexpected checkpoint tensor {hf_name}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


@torch.no_grad()
def _init_dummy(model: DecoderModel, seed: int) -> None:
    """Random weights made in place (like vLLM's --load-format dummy): norms at 1,
    matrices N(0, 0.02) so activations stay in a realistic range."""
    gen = torch.Generator(device=model.embed.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "bias" not in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
