"""Tiny FP8 checkpoints in each published layout, made from a float32 checkpoint here
(independently of the server's code), each with its dequantized float32 twin: the reference
transformers scores against.

Layouts: "block" (quant_method fp8, weight_scale_inv per r x c block: Qwen's and DeepSeek's
releases), "block_ws" (the same spelled weight_scale), "ct_channel" (compressed-tensors,
per-row weight_scale [N, 1], dynamic per-token activations), "ct_tensor_static"
(compressed-tensors, per-tensor weight_scale, [1] and [] shapes both, static input_scale),
"ct_block" (compressed-tensors FP8_BLOCK: weight_scale per block, 1 x 128 dynamic
activation groups), "fp8_tensor_static" (quant_method fp8 without weight_block_size, AutoFP8's:
per-tensor weight_scale and a static input_scale), "online" (the bf16 checkpoint itself, served
with --quantization fp8: its twin holds each projection quantized per row and back).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
MAX = 448.0
# The projections of every family (attention, MLP, experts, Gated DeltaNet in/out); not the
# embedding, LM head, routers, shared-expert gates, norms or convolutions.
PROJECTION = re.compile(r"(_proj|_proj_(qkv|qkvz|ba|z|b|a)|_proj_with_mqa|\.w[123])\.weight$")
LAYOUTS = ("block", "block_ws", "ct_channel", "ct_tensor_static", "ct_block", "fp8_tensor_static", "online")


def _amax_scale(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax().clamp(min=1e-12) / MAX


def _q(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (w / s).clamp(-MAX, MAX).to(FP8)


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scales [ceil(N / r), ceil(K / c)]): one scale per block, its amax / 448."""
    r, c = block
    n, k = w.shape
    s = torch.empty(-(-n // r), -(-k // c))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = _amax_scale(w[i * r:(i + 1) * r, j * c:(j + 1) * c])
    full = s.repeat_interleave(r, 0).repeat_interleave(c, 1)[:n, :k]
    return _q(w, full), s


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scales [N, 1]): the server's --quantization fp8 formula."""
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / MAX
    return _q(w, s), s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    if block is None:
        return q.float() * s
    r, c = block
    return q.float() * s.repeat_interleave(r, 0).repeat_interleave(c, 1)[:q.shape[0], :q.shape[1]]


def quantization_config(layout: str, block: tuple[int, int], ignore: tuple[str, ...]) -> dict:
    if layout.startswith("block"):
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", *ignore]}
    if layout == "fp8_tensor_static":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", *ignore]}
    static = layout == "ct_tensor_static"
    acts = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": not static,
            "strategy": {"ct_tensor_static": "tensor", "ct_block": "group"}.get(layout, "token")}
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
               "strategy": {"ct_tensor_static": "tensor", "ct_block": "block"}.get(layout, "channel")}
    if layout == "ct_block":
        acts["group_size"], weights["block_structure"] = 128, list(block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                          "weights": weights}},
            "ignore": ["lm_head", *(f"re:.*{i}$" for i in ignore)], "kv_cache_scheme": None}


def make_fp8(src: Path, dst: Path, layout: str, block: tuple[int, int] = (16, 16),
             ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """(the FP8 checkpoint of ``src`` in ``layout``, its dequantized float32 twin). Projections
    whose name ends in one of ``ignore`` stay float32 (the checkpoint's ignore list says so)."""
    assert layout in LAYOUTS, layout
    fp8_dir, twin = dst / "fp8", dst / "twin"
    for d in (fp8_dir, twin):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    out, ref = dict(tensors), dict(tensors)
    for k, (name, w) in enumerate(sorted(tensors.items())):
        if not PROJECTION.search(name) or "visual" in name or any(name.endswith(i + ".weight") for i in ignore):
            continue
        prefix = name.removesuffix("weight")
        if layout == "online":
            q, s = quantize_rows(w.float())
            ref[name] = dequantize(q, s)
            continue
        if layout.startswith("block") or layout == "ct_block":
            q, s = quantize_block(w.float(), block)
            ref[name] = dequantize(q, s, block)
        elif layout == "ct_channel":
            q, s = quantize_rows(w.float())
            ref[name] = dequantize(q, s)
        else:  # per tensor (ct_tensor_static, fp8_tensor_static); every other scale a 0-d tensor (older exports)
            s = _amax_scale(w.float()).reshape(() if k % 2 else (1,))
            q = _q(w.float(), s)
            ref[name] = q.float() * s
            out[prefix + "input_scale"] = torch.tensor([0.02 + 0.001 * (k % 7)])
        out[name] = q
        out[prefix + ("weight_scale_inv" if layout == "block" else "weight_scale")] = s
    if layout != "online":
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = quantization_config(layout, block, ignore)
        (fp8_dir / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return fp8_dir, twin
