"""The lengths the cuDNN backend runs attention at: a few per power of two, so its
execution plans (built once per shape) are few and can be made at start-up."""

from __future__ import annotations


def bucket(n: int, per_octave: int = 16) -> int:
    """n rounded up to the next of ``per_octave`` steps per power of two (multiples of 64
    up to 1024). Waste: under 1/per_octave of n."""
    g = 64 if n <= 1024 else (1 << (n.bit_length() - 1)) // per_octave
    return -(-n // g) * g


def bucket_floor(n: int, per_octave: int = 8) -> int:
    """The largest bucket value (``per_octave`` per power of two) not above n; 0 below 64."""
    if n < 64:
        return 0
    g = 64 if n <= 1024 else (1 << (n.bit_length() - 1)) // per_octave
    return (n // g) * g


def size_class(n: int, per_octave: int) -> int:
    """A length rounded up for a graph: 256, 512 or 1024, then ``per_octave`` steps per power
    of two."""
    for c in (256, 512, 1024):
        if n <= c:
            return c
    return bucket(n, per_octave)


def batch_class(b: int) -> int:
    """A sequence count rounded up to a power of two."""
    return 1 << max(b - 1, 0).bit_length()
