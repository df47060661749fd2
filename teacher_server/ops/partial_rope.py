"""q/k preparation with rotary on part of each head (GLM-4.5: the first half), a stage of
``FusedOps`` (compiled into a few fused passes where the stages are compiled): split the fused
QKV output, the optional per-head RMSNorm of q and k, rotary on their first ``rotary_dim``
dims in neox-style halves of that part (float32 math, rounded once), the rest copied."""

from __future__ import annotations

from collections.abc import Callable

import torch

from teacher_server.ops.checks import assert_close
from teacher_server.ops.norm import rms_norm
from teacher_server.ops.qkv_rope import HeadLayout


def rotate_part(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with its first r dims rotated by cs [T, r] (cos | sin, float32)."""
    half = cs.shape[1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), x[..., 2 * half:]], -1)


def partial_qk_prep(qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                    n_q: int, n_kv: int, d: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, n_q, d], k, v [T, n_kv, d] (contiguous) from fused QKV [T, (n_q + 2 n_kv) d] and the
    step's rotary rows cs [T, r], r <= d. (Plain ints: ``FusedOps`` compiles this function.)"""
    t = qkv.shape[0]
    q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q, k = q.reshape(t, n_q, d), k.reshape(t, n_kv, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return rotate_part(q, cs).contiguous(), rotate_part(k, cs).contiguous(), v.reshape(t, n_kv, d).contiguous()


def check_partial_qk_prep(stage: Callable, heads: HeadLayout, q_norm: torch.Tensor | None,
                          k_norm: torch.Tensor | None, cos_sin: torch.Tensor, device: torch.device,
                          dtype: torch.dtype) -> None:
    """Start-up check of a compiled ``stage`` against ``partial_qk_prep`` at a model's heads,
    norm weights and rotary table (two token counts: the static, then the dynamic graph).
    Raises RuntimeError on a mismatch."""
    for n in (16, 40):
        qkv = torch.randn(n, heads.width, device=device, dtype=dtype)
        cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]
        args = (qkv, cs, q_norm, k_norm, heads.n_q, heads.n_kv, heads.d, heads.eps)
        for got, ref in zip(stage(*args), partial_qk_prep(*args)):
            assert_close("compiled partial_qk_prep", got, ref)
