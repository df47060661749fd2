"""The rotary embedding's facts of a config.json, read as transformers reads them.

- ``rope_scaling``, where a file gives it, replaces ``rope_parameters`` whole (a legacy
  ``{"type": "yarn"}`` added to a config that transformers 5 saved with a default rope).
- ``rope_theta`` from the rope dict, else the top level.
- For llama3 and YaRN, a top-level ``original_max_position_embeddings`` wins over the dict's
  (transformers' exception for configs that keep the pretraining length outside the dict);
  without either it is ``max_position_embeddings``.
- YaRN with ``"factor": null`` takes ``max_position_embeddings / original_max_position_embeddings``.

What would be read otherwise, or fail after the weights have loaded, is refused here.
"""

from __future__ import annotations

from typing import Any

from teacher_server.models.config_fields import is_number
from teacher_server.unsupported import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# (Qwen3.5's multimodal rope keys: text positions the same on every axis, plain rope)
_NOT_SCALING = frozenset({"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"})
# the numbers each scaling needs; YaRN's factor may be null (derived)
_NEEDS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "linear": ("factor",), "yarn": ("factor",)}
_NULLABLE = {("yarn", "factor")}
_PRETRAINED_LEN = "original_max_position_embeddings"


def rope_facts(d: dict[str, Any]) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """(the rope dict as the file gives it, rope_theta, the scaling keys ``rotary`` reads with
    ``rope_type`` set) of config dict ``d`` (the registry's defaults applied)."""
    rope_params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))  # transformers' order
    merged = {k: v for k, v in rope_params.items() if k not in _NOT_SCALING}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    merged["rope_type"] = rope_type
    missing = [k for k in _NEEDS.get(rope_type, ()) if k not in merged]
    if missing:  # (refused here, not after the weights have loaded)
        raise UnsupportedModelError(f"{rope_type} rope scaling without {', '.join(missing)}")
    bad = [k for k in _NEEDS.get(rope_type, ()) if not is_number(merged[k])
           and not (merged[k] is None and (rope_type, k) in _NULLABLE)]
    if bad:
        raise UnsupportedModelError(f"{rope_type} rope scaling with " + ", ".join(
            f"{k}={merged[k]!r}" for k in bad) + ": a number")
    if rope_type in ("llama3", "yarn"):
        max_pos = d.get("max_position_embeddings", 4096)
        if d.get(_PRETRAINED_LEN) is not None:
            merged[_PRETRAINED_LEN] = d[_PRETRAINED_LEN]
        elif merged.get(_PRETRAINED_LEN) is None:
            merged[_PRETRAINED_LEN] = max_pos
        if not is_number(merged[_PRETRAINED_LEN]) or merged[_PRETRAINED_LEN] <= 0:
            raise UnsupportedModelError(f"{rope_type} rope scaling with {_PRETRAINED_LEN}="
                                        f"{merged[_PRETRAINED_LEN]!r}: a positive number")
        if merged["factor"] is None:
            merged["factor"] = max_pos / merged[_PRETRAINED_LEN]
    return rope_params, theta, merged
