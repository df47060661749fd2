"""The Gemma 3 facts of a config.json (``Gemma3ForCausalLM``, or the ``text_config`` of
``Gemma3ForConditionalGeneration``), read into ``GemmaDims`` and the ``ModelSpec`` fields
they set.

Two config layouts exist. The hub's: ``rope_theta`` and ``rope_scaling`` for the global
layers, ``rope_local_base_freq`` for the local ones, ``sliding_window_pattern`` (every
pattern-th layer global) where ``layer_types`` is absent. The one transformers 5 writes:
``rope_parameters`` holding one dict per layer kind (``full_attention``,
``sliding_attention``). ``gemma3_config`` rewrites the second into the first, so the
generic rope parsing reads the global layers' rope.

What changes the math and is not built is refused by name: attention logit soft-capping
(Gemma 2's; None in every Gemma 3), bidirectional attention (EmbeddingGemma), a scaled rope
on the local layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from teacher_server.unsupported import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaDims:
    """What Gemma 3 adds to a Llama-shaped spec."""

    local_rope_theta: float  # rotary base of the sliding-window layers (plain rope)
    query_pre_attn_scalar: float  # the softmax scale is its inverse square root (not head_dim's)
    final_logit_softcapping: float | None  # logits become cap * tanh(logits / cap); None: not capped


def gemma3_config(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with transformers 5's per-kind ``rope_parameters`` rewritten into the hub's keys
    (the global layers' rope as ``rope_parameters``, the local base as ``rope_local_base_freq``);
    a hub-layout ``d`` is returned as it is."""
    # (transformers' per-kind rope reads the pretraining length from the dicts alone)
    d = {k: v for k, v in d.items() if k != "original_max_position_embeddings"}
    rp = d.get("rope_parameters")
    if not isinstance(rp, dict) or not ({SLIDING, FULL} & rp.keys()):
        return d
    local = dict(rp.get(SLIDING) or {})
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"Gemma 3 with rope_type={local['rope_type']!r} on its sliding-window layers "
                                    "is not supported (plain rope there)")
    full = dict(rp.get(FULL) or {"rope_type": "default"})
    if isinstance(d.get("rope_scaling"), dict):  # a legacy rope_scaling beside them: merged into the global
        full.update(d["rope_scaling"])           # layers' rope, as transformers does
    out = {**d, "rope_parameters": full}
    out.pop("rope_scaling", None)  # (now in the global layers' dict)
    if "rope_theta" in local:
        out["rope_local_base_freq"] = local["rope_theta"]
    return out


def gemma3_facts(d: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a Gemma 3 config (d holds the registry's defaults under the
    file's keys, rewritten by ``gemma3_config``)."""
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"Gemma 3 with attn_logit_softcapping={d['attn_logit_softcapping']} is not "
                                    "supported (no Gemma 3 sets it)")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention=true (an embedding model) is not "
                                    "supported: scoring is causal")
    layers = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern") or 6)
    types = tuple(d.get("layer_types") or (SLIDING if (i + 1) % pattern else FULL for i in range(layers)))
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types {list(types)!r} for {layers} layers")
    if SLIDING in types and not d.get("sliding_window"):
        raise UnsupportedModelError("Gemma 3 with sliding_attention layers and no sliding_window")
    cap = d.get("final_logit_softcapping")
    if cap is not None and not float(cap) > 0:
        raise UnsupportedModelError(f"final_logit_softcapping={cap}: a positive cap or null")
    dims = GemmaDims(float(d.get("rope_local_base_freq") or 10000.0), float(d["query_pre_attn_scalar"]),
                     None if cap is None else float(cap))
    return dict(gemma=dims, layer_types=types, zero_centered_norm=True)
