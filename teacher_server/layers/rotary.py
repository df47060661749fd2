"""Rotary position embedding: inverse frequencies for each supported scaling, and a
cos/sin table indexed by absolute position (so chunked prefill needs no per-chunk work)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq_and_scale(head_dim: int, base: float, rs: dict[str, Any],
                       max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return ([head_dim // 2] float32 inverse frequencies, attention scaling of cos/sin) for
    rope scaling ``rs`` (``rope_type`` default, linear, llama3 or yarn, with its keys)."""
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rs.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rs["factor"]), 1.0
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, base, rs, max_position_embeddings, inv_freq)
    raise ValueError(f"unsupported rope type {kind!r}")


def _yarn(dim: int, base: float, rs: dict[str, Any], max_pos: int,
          inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = float(rs["factor"])
    orig = rs.get("original_max_position_embeddings") or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra_factor = 1 - ramp
    interp = inv_freq / factor
    return interp * (1 - extra_factor) + inv_freq * extra_factor, float(attn)


class RotaryEmbedding:
    """The cos/sin table of every position up to max_len: ``table`` [max_len, head_dim]
    float32, first half cos, second half sin (already scaled). Calling it with a step's
    positions gives that step's rows, which the QKV stage rotates q and k by."""

    def __init__(self, head_dim: int, base: float, rope_scaling: dict[str, Any], max_position_embeddings: int,
                 max_len: int, device: torch.device) -> None:
        inv_freq, scale = inv_freq_and_scale(head_dim, base, rope_scaling, max_position_embeddings)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, head_dim // 2]
        self.table = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] int64 absolute positions -> [T, head_dim] float32 cos | sin."""
        return self.table[positions]
