"""``.npy`` bytes -> array without ``np.load``, so without ``ast`` (numpy only: the client uses it).

``np.load`` reads the header, a Python dict literal, with ``ast.literal_eval``. Before CPython
3.11.8 and 3.12.2 the AST constructor keeps its recursion counter in state shared by every
thread (python/cpython#106905): a garbage collection inside it that runs Python code (a
finaliser, a weakref callback) can hand the GIL to another thread that parses too, and the
first call then fails with ``SystemError: AST constructor recursion depth mismatch``. The
server decodes candidates on its event loop and its parsing thread while other threads of the
process parse (a client's worker threads decoding results, in tests and in trainers that host
both), so a valid request now and then got 400 "not a valid .npy array", and a valid response
could fail to decode. The header is a small fixed grammar, read here by a tokenizer; the rest
follows ``np.load``: versions 1.0 to 3.0, its header size limit, ``descr_to_dtype``, Fortran
order, and no object arrays (nothing is ever unpickled).
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any

import numpy as np
from numpy.lib.format import descr_to_dtype

MAGIC = b"\x93NUMPY"
MAX_HEADER_SIZE = 10_000  # np.load's default limit on the header's length
_LENGTH_FORMAT = {1: "<H", 2: "<I", 3: "<I"}  # major version -> header length field
_KEYS = frozenset({"descr", "fortran_order", "shape"})
_TOKEN = re.compile(r"""\s*(?:(?P<str>'[^'\\]*'|"[^"\\]*")  # strings without escapes
                       |(?P<int>-?\d+)L?  # (a Python 2 header's longs end in L)
                       |(?P<name>True|False|None)
                       |(?P<punct>[{}()\[\],:]))""", re.VERBOSE | re.ASCII)
_NAMES = {"True": True, "False": False, "None": None}
_MAX_DEPTH = 8  # a header nests a dict, a descr list and its field tuples


def load_npy(raw: bytes, exact: bool = False) -> np.ndarray:
    """The array held by ``.npy`` bytes (a copy: it does not keep ``raw`` alive). Raises
    ValueError for anything ``np.load(..., allow_pickle=False)`` would refuse, and for object
    arrays; trailing bytes after the data are ignored, as ``np.load`` ignores them, unless
    ``exact``: then they are refused too (a payload that holds one array and more bytes has a
    header whose shape is not its data's, and read as the header says its rows are misaligned)."""
    if raw[:len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 2:
        raise ValueError("not a .npy array (no magic string)")
    major, minor = raw[len(MAGIC)], raw[len(MAGIC) + 1]
    if major not in _LENGTH_FORMAT or minor != 0:
        raise ValueError(f"unsupported .npy version {major}.{minor}")
    fmt = _LENGTH_FORMAT[major]
    start = len(MAGIC) + 2 + struct.calcsize(fmt)
    if len(raw) < start:
        raise ValueError("truncated .npy header")
    (length,) = struct.unpack_from(fmt, raw, len(MAGIC) + 2)
    end = start + length
    if len(raw) < end:
        raise ValueError("truncated .npy header")
    header = raw[start:end].decode("utf-8" if major == 3 else "latin1")
    if len(header) > MAX_HEADER_SIZE:
        raise ValueError(f"header of {len(header)} characters exceeds {MAX_HEADER_SIZE}")
    shape, fortran_order, dtype = _parse_header(header)
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    if dtype.itemsize == 0:  # (np.empty would widen it to one byte per item: gigabytes for a tiny header)
        raise ValueError(f"zero-size dtype {dtype.str!r} is not accepted")
    count = math.prod(shape)
    if len(raw) - end < count * dtype.itemsize:
        raise ValueError(f"truncated .npy data: {count} x {dtype.itemsize} bytes expected, "
                         f"{len(raw) - end} found")
    if exact and len(raw) - end > count * dtype.itemsize:
        raise ValueError(f"{len(raw) - end - count * dtype.itemsize} bytes after the data of shape {list(shape)} "
                         f"({count} x {dtype.itemsize} bytes): the header's shape is not the data's")
    flat = np.frombuffer(raw, dtype, count=count, offset=end).copy()
    return flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)


def _parse_header(header: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    d = _Literal(header).parse()
    if not isinstance(d, dict) or d.keys() != _KEYS:
        raise ValueError(f"header is not a dict of {sorted(_KEYS)}: {header[:200]!r}")
    shape, fortran_order = d["shape"], d["fortran_order"]
    if not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape):
        raise ValueError(f"shape is not valid: {shape!r}")
    if not isinstance(fortran_order, bool):
        raise ValueError(f"fortran_order is not a valid bool: {fortran_order!r}")
    try:
        dtype = descr_to_dtype(d["descr"])
    except Exception as e:  # TypeError, ValueError, ... from a descr numpy cannot read
        raise ValueError(f"descr is not a valid dtype descriptor: {d['descr']!r}") from e
    return shape, fortran_order, dtype


class _Literal:
    """The literals a ``.npy`` header holds: dicts, tuples, lists, strings without escapes,
    integers, True, False and None; trailing spaces and newline allowed."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, Any]] = []
        pos, n = 0, len(text.rstrip())
        while pos < n:
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"cannot parse header at {text[pos:pos + 20]!r}")
            kind = m.lastgroup
            value = m.group(kind)
            if kind == "str":
                value = value[1:-1]
            elif kind == "int":
                value = int(value)
            elif kind == "name":
                value = _NAMES[value]
            self.tokens.append((kind, value))
            pos = m.end()
        self.i = 0

    def parse(self) -> Any:
        value = self._value(0)
        if self.i != len(self.tokens):
            raise ValueError("trailing tokens after the header's dict")
        return value

    def _next(self) -> tuple[str, Any]:
        if self.i >= len(self.tokens):
            raise ValueError("header ends early")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def _peek_punct(self, ch: str) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i] == ("punct", ch)

    def _value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError("header nests too deeply")
        kind, value = self._next()
        if kind != "punct":
            return value
        if value == "{":
            items, _ = self._items("}", depth, pairs=True)
            return dict(items)
        if value == "(":
            items, commas = self._items(")", depth, pairs=False)
            return items[0] if len(items) == 1 and not commas else tuple(items)  # (x) is x, as in Python
        if value == "[":
            return self._items("]", depth, pairs=False)[0]
        raise ValueError(f"unexpected {value!r} in header")

    def _items(self, close: str, depth: int, *, pairs: bool) -> tuple[list, int]:
        """Comma-separated values (or string key: value pairs) up to ``close`` (a trailing
        comma allowed), and the number of commas."""
        out: list = []
        commas = 0
        while not self._peek_punct(close):
            if pairs:
                key = self._value(depth + 1)
                if not isinstance(key, str) or self._next() != ("punct", ":"):
                    raise ValueError("the header's dict must map strings to values")
                out.append((key, self._value(depth + 1)))
            else:
                out.append(self._value(depth + 1))
            if self._peek_punct(","):
                self.i += 1
                commas += 1
            elif not self._peek_punct(close):
                raise ValueError(f"expected ',' or {close!r} in header")
        self.i += 1
        return out, commas
