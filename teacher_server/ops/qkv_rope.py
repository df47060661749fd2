"""qkv_rope: split the fused QKV projection's output, per-head RMSNorm of q and k (Qwen3),
rotary on q and k, and the write of k and v into the KV pool, in one CUDA kernel pass
(``kernels/elementwise.cu``). The torch reference is ``qkv_prep`` plus an indexed store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from teacher_server.ops import extension
from teacher_server.ops.checks import assert_close
from teacher_server.ops.norm import rms_norm
from teacher_server.ops.silu_mul import HALF, aligned
from teacher_server.ops.slack import alloc_with_slack

if TYPE_CHECKING:
    from teacher_server.step_context import StepContext


class KVStore(Protocol):
    """What the QKV stage needs of the KV pool (``kv_pool.KVPool``)."""

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None: ...

    def store_target(self, layer: int,
                     ctx: StepContext) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]: ...


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of one layer: n_q query heads, n_kv key/value heads of head_dim
    d (on this rank), and the eps of the per-head q/k norms."""

    n_q: int
    n_kv: int
    d: int
    eps: float

    @property
    def width(self) -> int:
        """Columns of the fused QKV output: (n_q + 2 n_kv) d."""
        return (self.n_q + 2 * self.n_kv) * self.d


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qkv_prep(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, n_q: int, n_kv: int, d: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused QKV [T, (n_q + 2 n_kv) d], per-head RMSNorm of q and k (Qwen3), rotary
    on q and k (cos/sin: [T, 1, d/2] float32). Returns contiguous q [T, n_q, d], k, v [T, n_kv, d].
    (Plain ints, not a HeadLayout: ``FusedOps`` compiles this function.)"""
    t = qkv.shape[0]
    q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q = q.reshape(t, n_q, d)
    k = k.reshape(t, n_kv, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    return _rotate(q, cos, sin).contiguous(), _rotate(k, cos, sin).contiguous(), v.reshape(t, n_kv, d).contiguous()


# Heads of one token each group of lanes takes, their loads all issued before it computes
# (the largest of 8, 4, 2, 1 not above this that divides the heads); the other settings are
# there for ``bench/bench_kernel.py``.
ITEMS_PER_GROUP = 4


def qkv_rope(qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
             heads: HeadLayout, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
             slots: torch.Tensor | None = None,
             items_per_group: int = ITEMS_PER_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [T, n_q, d], k, v [T, n_kv, d] from qkv [T, (n_q + 2 n_kv) d] and cs [T, d] (cos | sin);
    k, v also go to the cache rows ``slots`` ([T] int64, -1: none) of k_cache / v_cache
    ([slots, n_kv, d]). q, k and v have slack rows (``alloc_with_slack``). None when the
    kernel cannot take the input (the caller runs the torch stages)."""
    n_q, n_kv, d = heads.n_q, heads.n_kv, heads.d
    if not (qkv.is_cuda and qkv.dtype in HALF and d in (64, 128, 256) and qkv.dim() == 2 and qkv.stride(1) == 1
            and qkv.stride(0) % 8 == 0 and aligned(qkv) and (q_norm is None) == (k_norm is None)
            and cs.dtype == torch.float32 and cs.stride(1) == 1
            and all(w is None or (w.is_contiguous() and aligned(w)) for w in (q_norm, k_norm))
            and all(c is None or aligned(c) for c in (k_cache, v_cache))
            and qkv.shape[0] * (heads.width // 8) < 2**31):  # the kernel's 32-bit indices
        return None
    ext = extension.load()
    if ext is None:
        return None
    t = qkv.shape[0]
    q = alloc_with_slack(qkv, t, n_q, d, front=True)
    k, v = alloc_with_slack(qkv, t, n_kv, d), alloc_with_slack(qkv, t, n_kv, d)
    write = slots is not None and k_cache is not None
    ext.qkv_rope_out(qkv, cs, q_norm, k_norm, heads.eps, q, k, v, k_cache if write else None,
                     v_cache if write else None, slots if write else None, items_per_group)
    return q, k, v


def check_qkv_rope(heads: HeadLayout, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   cos_sin: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """Start-up check: the kernel against ``qkv_prep`` plus the indexed store, cache writes
    included (some tokens not written), at the model's head layout and norm weights.
    Raises RuntimeError on a mismatch; passes when the kernel does not take the input."""
    n = 40
    qkv = torch.randn(n, heads.width, device=device, dtype=dtype)
    cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]  # [n, d] float32
    slots = torch.arange(n, device=device) * 2
    slots[::3] = -1  # some tokens are not written
    keep = slots >= 0
    caches = [torch.zeros(2 * n, heads.n_kv, heads.d, device=device, dtype=dtype) for _ in range(4)]
    got = qkv_rope(qkv, cs, q_norm, k_norm, heads, caches[0], caches[1], slots)
    if got is None:
        return
    half = heads.d // 2
    ref = qkv_prep(qkv, cs[:, None, :half], cs[:, None, half:], q_norm, k_norm, heads.n_q, heads.n_kv, heads.d,
                   heads.eps)
    caches[2][slots[keep]] = ref[1][keep]
    caches[3][slots[keep]] = ref[2][keep]
    for name, g, r in zip(("q", "k", "v", "k_cache", "v_cache"), (*got, caches[0], caches[1]), (*ref, *caches[2:])):
        assert_close(f"qkv_rope {name}", g, r)
