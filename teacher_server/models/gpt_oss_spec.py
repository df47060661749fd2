"""The gpt-oss facts of a config.json: which layers slide (``layer_types``; transformers'
default alternates, sliding first) and the clamped SwiGLU's constants. Every layer is an
expert layer and every attention layer has sinks."""

from __future__ import annotations

from typing import Any

from teacher_server.unsupported import UnsupportedModelError


def gpt_oss_facts(d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    types = tuple(d.get("layer_types") or ("sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(num_layers)))
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {list(types)!r} for {num_layers} layers")
    if "sliding_attention" in types and not d.get("sliding_window"):
        raise UnsupportedModelError("sliding_attention layers without a sliding_window")
    return dict(layer_types=types, swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)), attention_sinks=True)
