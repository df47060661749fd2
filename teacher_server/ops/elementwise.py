"""Memory-bound elementwise ops of the forward: CUDA kernels from ``csrc/elementwise.cu``
(built with the gather-logprob kernel into one library) with torch fallbacks that define
the exact semantics (CPU, float32, odd shapes, or no kernel).

- ``silu_mul``: [T, 2I] -> [T, I], ``silu(gate) * up``, rounded as eager torch rounds.
- ``merge_attn``: two partial attentions over disjoint key sets, merged by log-sum-exp.
- ``qkv_rope``: split fused QKV, per-head RMSNorm, rotary, and the KV-pool write, in one
  pass (the torch version is ``model.fused.qkv_prep`` plus an indexed store).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teacher_server.ops.gather_logprob import _load

_HALF = (torch.bfloat16, torch.float16)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    if (gate_up.is_cuda and gate_up.dtype in _HALF and gate_up.dim() == 2 and gate_up.shape[1] % 16 == 0
            and gate_up.stride(1) == 1 and gate_up.stride(0) % 8 == 0 and _aligned(gate_up)):
        ext = _load()
        if ext is not None:
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            ext.silu_mul_out(gate_up, out)
            return out
    return silu_mul_reference(gate_up)


def merge_attn_reference(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """o1, o2: [c, H, D]; l1, l2: [H, c] float32 log-sum-exps. Returns [c, H, D] in o1's dtype."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    tot = w1 + w2
    tot = torch.where(tot > 0, tot, torch.ones_like(tot))
    w1, w2 = (w1 / tot).t()[:, :, None], (w2 / tot).t()[:, :, None]  # [c, H, 1]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def merge_attn(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the merged attention into out ([c, H, D]) and return it."""
    ok = all(t.is_cuda and t.dtype in _HALF and t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0
             and _aligned(t) for t in (o1, o2, out)) and o1.shape[-1] % 8 == 0
    if ok and l1.dtype == torch.float32 and l2.dtype == torch.float32:
        ext = _load()
        if ext is not None:
            ext.merge_attn_out(o1, l1, o2, l2, out)
            return out
    return out.copy_(merge_attn_reference(o1, l1, o2, l2))


def alloc_with_slack(like: torch.Tensor, t: int, h: int, d: int, front: bool = False) -> torch.Tensor:
    """[t, h, d] rows inside a larger buffer: zeroed slack rows after (and uninitialised ones
    before, when ``front``), which the cuDNN attention backend uses as padding without copies."""
    from teacher_server.model.attention import slack_rows

    sl = slack_rows(t)
    f = sl if front else 0
    buf = like.new_empty(f + t + sl, h, d)
    buf[f + t:].zero_()
    return buf[f:f + t]


def qkv_rope(qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
             eps: float, n_q: int, n_kv: int, d: int, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
             slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [T, n_q, d], k, v [T, n_kv, d] from qkv [T, (n_q + 2 n_kv) d] and cs [T, d] (cos | sin);
    k, v also go to the pool rows ``slots`` (-1: none). None when the kernel cannot take it."""
    if not (qkv.is_cuda and qkv.dtype in _HALF and d in (64, 128, 256) and qkv.dim() == 2 and qkv.stride(1) == 1
            and qkv.stride(0) % 8 == 0 and _aligned(qkv) and (q_norm is None) == (k_norm is None)
            and cs.dtype == torch.float32 and cs.stride(1) == 1):
        return None
    ext = _load()
    if ext is None:
        return None
    t = qkv.shape[0]
    q, k, v = alloc_with_slack(qkv, t, n_q, d, front=True), alloc_with_slack(qkv, t, n_kv, d), \
        alloc_with_slack(qkv, t, n_kv, d)
    write = slots is not None and k_cache is not None
    ext.qkv_rope_out(qkv, cs, q_norm, k_norm, eps, q, k, v, k_cache if write else None, v_cache if write else None,
                     slots if write else None)
    return q, k, v
