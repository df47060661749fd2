"""The linear-attention facts of a hybrid (Qwen3.5, Qwen3-Next) config.json, for ``ModelSpec``."""

from __future__ import annotations

from typing import Any

from teacher_server.unsupported import UnsupportedModelError


def hybrid_facts(d: dict[str, Any], num_layers: int, rope_params: dict[str, Any]) -> dict[str, Any]:
    """The linear-attention facts of a Qwen3.5 config.json. ``layer_types`` defaults as
    transformers does: every ``full_attention_interval``-th layer (4) is full attention."""
    interval = int(d.get("full_attention_interval") or 4)
    types = tuple(d.get("layer_types") or ("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                           for i in range(num_layers)))
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {list(types)!r} for {num_layers} layers")
    if "full_attention" not in types:  # nothing would hold KV: the engine's memory plan assumes some layer does
        raise UnsupportedModelError("a hybrid model whose layers are all linear attention is not supported "
                                    "(layer_types has no full_attention layer)")
    facts = dict(
        layer_types=types,
        linear_num_key_heads=int(d["linear_num_key_heads"]),  # (defaults: the registry's)
        linear_num_value_heads=int(d["linear_num_value_heads"]),
        linear_key_head_dim=int(d["linear_key_head_dim"]),
        linear_value_head_dim=int(d["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]),
        partial_rotary_factor=float(rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
        attn_output_gate=bool(d.get("attn_output_gate", True)),
        zero_centered_norm=True,
    )
    if not facts["attn_output_gate"]:  # (transformers' Qwen3.5 gates whatever the flag says; vLLM's reads it)
        raise UnsupportedModelError("attn_output_gate=false (full-attention layers without the output gate) is not "
                                    "supported; the gated layers of the Qwen3.5 and Qwen3-Next releases are")
    if facts["linear_num_value_heads"] % facts["linear_num_key_heads"]:
        raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return facts
