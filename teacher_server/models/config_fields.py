"""config.json's numbers checked by name before the spec reads them: a size given as null, a
list, text or a fraction, a count of 0, a rope parameter that is not a number, would otherwise
stop the start with a bare ``TypeError`` or ``ZeroDivisionError`` naming no key, or (a float
head count) be cut to a whole number and another model built."""

from __future__ import annotations

import json
from typing import Any

from teacher_server.unsupported import UnsupportedModelError

# The keys every family reads (a family's own keys are its facts' to check: a family that does not
# read one, as Mixtral decoder_sparse_step, takes any value there, as transformers does).
# whole numbers of at least 1, where given (the four first: always given, the family's default at least)
POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings")
REQUIRED = POSITIVE[:4]
# whole numbers of at least 0, where given (0: none, as the families' configs use it)
COUNTS = ("intermediate_size", "sliding_window")
NUMBERS = ("rms_norm_eps", "rope_theta")
ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor")


def _bad(key: str, value: Any, want: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json's {key} is {json.dumps(value, default=str)}: {want}")


def is_number(v: Any) -> bool:
    """A JSON number (not a bool): what config.json's numeric keys must hold."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_fields(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` (config.json's keys over the family's defaults) when its numbers are numbers of the
    right kind; else an ``UnsupportedModelError`` naming the key and what it needs."""
    for key in POSITIVE + COUNTS:
        v = d.get(key)
        if v is None:
            if key in REQUIRED and key in d:
                raise _bad(key, v, "a whole number is needed")
            continue
        low = 1 if key in POSITIVE else 0
        if not is_number(v) or not float(v).is_integer() or v < low:
            raise _bad(key, v, f"a whole number of at least {low} is needed")
    for key in NUMBERS:
        if d.get(key) is not None and not is_number(d[key]):
            raise _bad(key, d[key], "a number is needed")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise _bad(key, rope, "an object of rope parameters is needed")
        for name, v in (rope or {}).items():
            if name in ROPE_NUMBERS and v is not None and not is_number(v):
                raise _bad(f"{key}.{name}", v, "a number is needed")
    return d
