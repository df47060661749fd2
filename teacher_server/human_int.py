"""Integers with a size suffix, as vLLM's flags take them: ``32k`` = 32,000 (lowercase k, m, g,
t: powers of ten, decimals allowed: ``25.6k``), ``32K`` = 32,768 (uppercase K, M, G, T: powers
of two, whole numbers only)."""

from __future__ import annotations

import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_FORM = re.compile(r"([+-]?\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_int(text: str) -> int:
    """``text`` as an integer (see the module); ValueError naming the text otherwise."""
    m = _FORM.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text[:40]!r} is not an integer (suffixes: 32k = 32000, 32K = 32768)")
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:  # 1.5K is not a whole number of KiB-units
        raise ValueError(f"{text[:40]!r}: decimals go with k, m, g, t (powers of ten), not {suffix or 'no suffix'}")
    return int(number) * _BINARY.get(suffix, 1)
