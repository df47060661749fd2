"""The closest valid name to a misspelt one, for error messages (settings, dtypes, fields)."""

from __future__ import annotations

import difflib

# misspellings difflib does not find (a short name far from the long one)
DTYPE_HINTS = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32",
               # no float64 forward: float32 is the most precise one (a near spelling, float16, is the least)
               "float64": "float32", "fp64": "float32", "f64": "float32", "double": "float32"}


def did_you_mean(word: str, choices: list[str], hints: dict[str, str] | None = None) -> str:
    """``; did you mean 'x'?`` for the closest of ``choices`` (or a known misspelling), else ''."""
    best = (hints or {}).get(word.lower()) or next(iter(difflib.get_close_matches(word, choices, 1, 0.6)), None)
    return f"; did you mean {best!r}?" if best else ""
