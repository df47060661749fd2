"""The canonical workloads and model shapes (now in ``teacher_server.benchmark.workloads``, so
``teacher-server bench`` has them installed) and the random checkpoints the benchmarks load."""

from __future__ import annotations

import json
import os
from pathlib import Path

from teacher_server.benchmark.workloads import (  # noqa: F401  (re-exported for the bench scripts and tests)
    DEEPSEEK_V3_LAYERS,
    GEMMA3_27B,
    GLM45_AIR_LAYERS,
    GPT_OSS_20B,
    H200_PEAK,
    LLAMA33_70B,
    MOONLIGHT_16B_A3B,
    QWEN3_5_9B,
    QWEN3_5_35B_A3B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_32B,
    QWEN3_235B_A22B,
    QWEN3_NEXT_80B_A3B_LAYERS,
    Req,
    checkpoint_bytes,
    flop_ideal_speedup,
    flops,
    ideal_cached,
    make_workload,
    tiny,
    with_layers,
)

# Random checkpoints larger than this are written only where there is a GPU: on a CPU machine
# an 8B one takes ~11 GB of disk and most of an hour, for a benchmark that cannot run there.
CPU_CHECKPOINT_LIMIT_BYTES = 2 * 2**30


# quantization_config of a block-wise FP8 checkpoint as DeepSeek's and Qwen's FP8 releases spell it
# (128 x 128 weight blocks with weight_scale_inv, dynamic 1 x 128 activation groups)
BLOCK_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


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
    sharded safetensors; kept when already there. Without a GPU a checkpoint over
    ``CPU_CHECKPOINT_LIMIT_BYTES`` is refused (SystemExit) before anything is written, unless
    TEACHER_SERVER_BENCH_ALLOW_CPU_CHECKPOINT=1. Each shard is written under a ``.part`` name
    and renamed when whole, and a write that is stopped removes its part: no half-written
    shard is left behind or taken for a whole one."""
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors.index.json").exists():
        return write_config(path, cfg)
    size = checkpoint_bytes(cfg)
    if not torch.cuda.is_available() and size > CPU_CHECKPOINT_LIMIT_BYTES \
            and os.environ.get("TEACHER_SERVER_BENCH_ALLOW_CPU_CHECKPOINT") != "1":
        raise SystemExit(f"no GPU here: not writing a {size / 1e9:.1f} GB random checkpoint of "
                         f"{cfg['architectures'][0]} to {path} (the benchmark needs a GPU at this size). "
                         "Run with --tiny for a small model of the same family, or on a GPU machine")
    write_config(path, cfg)
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
            part = path / (fname + ".part")
            try:
                save_file({k: t.cpu() for k, t in shard.items()}, str(part), metadata={"format": "pt"})
                part.replace(path / fname)
            finally:
                part.unlink(missing_ok=True)  # stopped mid-write (Ctrl-C): no partial file left
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
