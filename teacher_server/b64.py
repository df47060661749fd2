"""base64 for the ``.npy`` payloads (candidates in, log-probs out), through pybase64 when it is
installed: its SIMD codec decodes a W1 request's 1.4 MB of candidates in ~0.1 ms where the
standard library takes ~5 ms, and encodes ~2x faster. In the server that time is the
process's GIL: the engine thread cannot launch kernels while a parsing thread holds it, so
the codec's time is taken from the GPU's queue (``bench/bench_request_path.py`` measures it).

Strict decoding as RFC 4648 has it, with either codec: only the alphabet, padding only at
the end and to a multiple of four (pybase64 also refuses padding past that, "QUJD=", which
the standard library lets through). The standard library is the fallback: pybase64 is a
requirement of the server, not of the client (whose install is numpy and httpx), which uses it
when it is installed."""

from __future__ import annotations

import base64

try:
    import pybase64 as _fast
except ImportError:  # a client-only install
    _fast = None


def decode(data: str | bytes, validate: bool = True) -> bytes:
    """base64 -> bytes; ``validate``: characters outside the alphabet are an error (else
    skipped). Invalid input raises a ValueError (``binascii.Error``, or for non-ASCII text
    ValueError itself) with either codec."""
    if _fast is not None:
        return _fast.b64decode(data, validate=validate)
    return base64.b64decode(data, validate=validate)


def encode(data: bytes | memoryview) -> str:
    """bytes -> base64 text."""
    if _fast is not None:
        return _fast.b64encode_as_string(data)
    return base64.b64encode(data).decode("ascii")


def fast() -> bool:
    """Whether the SIMD codec is in use."""
    return _fast is not None
