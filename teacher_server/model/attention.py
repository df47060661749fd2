"""Attention backends behind one interface: packed varlen causal attention where a
sequence's queries may be shorter than its keys (a cached prefix / earlier chunks precede
them; causal alignment is bottom-right).

- ``sdpa``: per-sequence ``scaled_dot_product_attention`` (CPU, and the reference).
- ``varlen``: torch's FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``).
- ``flash_attn``: the ``flash-attn`` package's ``flash_attn_varlen_func``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from teacher_server.model.context import StepContext

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                 scale: float, window: int | None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [Tk, Hkv, D] packed like ctx.cu_k. Returns [T, Hq, D]."""
        ...


class SdpaBackend:
    name = "sdpa"

    def __call__(self, q, k, v, ctx, scale, window):
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        qs = ks = 0
        for lq, lk in zip(ctx.q_lens, ctx.k_lens):
            qi = q[qs:qs + lq].transpose(0, 1)  # [Hq, lq, D]
            ki = k[ks:ks + lk].transpose(0, 1)  # [Hkv, lk, D]
            vi = v[ks:ks + lk].transpose(0, 1)
            if groups > 1:
                ki = ki.repeat_interleave(groups, dim=0)
                vi = vi.repeat_interleave(groups, dim=0)
            if lq == lk and window is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
            else:
                qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
                kpos = torch.arange(lk, device=q.device)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= kpos > qpos - window
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[qs:qs + lq] = o.transpose(0, 1)
            qs += lq
            ks += lk
        return out


class TorchVarlenBackend:
    """torch's varlen FlashAttention-2; a step whose sequences all have one length and no
    cached prefix (a dense batch) goes to cuDNN attention instead, which is faster there
    (measured on the H200: ~613 vs ~334 TFLOP/s)."""

    name = "varlen"

    def __init__(self, dense_cudnn: bool = True) -> None:
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        self._has_gqa_flag = "enable_gqa" in inspect.signature(varlen_attn).parameters
        self.dense_cudnn = dense_cudnn

    def _dense(self, q, k, v, ctx, scale):  # noqa: ANN001, ANN202
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, n = len(ctx.q_lens), ctx.q_lens[0]
        groups = q.shape[1] // k.shape[1]
        qd = q.view(b, n, q.shape[1], q.shape[2]).transpose(1, 2)
        kd = k.view(b, n, k.shape[1], k.shape[2]).transpose(1, 2)
        vd = v.view(b, n, v.shape[1], v.shape[2]).transpose(1, 2)
        if groups > 1:
            kd = kd.repeat_interleave(groups, dim=1)
            vd = vd.repeat_interleave(groups, dim=1)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(q.shape)

    def __call__(self, q, k, v, ctx, scale, window):
        if self.dense_cudnn and window is None and ctx.uniform:
            try:
                return self._dense(q, k, v, ctx, scale)
            except RuntimeError as e:  # cuDNN refused these shapes: stay on varlen from now on
                log.warning("dense cuDNN attention unavailable (%s); using varlen", e)
                self.dense_cudnn = False
        kw = {"scale": scale, "window_size": (-1 if window is None else window - 1, 0)}
        if self._has_gqa_flag and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        return self._fn(q, k, v, ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k, **kw)


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def __call__(self, q, k, v, ctx, scale, window):
        ws = (-1, -1) if window is None else (window - 1, 0)
        return self._fn(q, k, v, ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k,
                        softmax_scale=scale, causal=True, window_size=ws)


def make_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """Build the named backend; ``auto`` picks flash_attn > varlen on CUDA for bf16/fp16,
    sdpa on CPU and for float32 (the flash kernels take half precision only)."""
    if name == "auto":
        if device.type != "cuda" or dtype == torch.float32:
            return SdpaBackend()
        for cand in ("flash_attn", "varlen"):
            try:
                return make_backend(cand, device)
            except Exception as e:  # missing package or op: try the next one
                log.info("attention backend %s unavailable: %s", cand, e)
        return SdpaBackend()
    if name == "sdpa":
        return SdpaBackend()
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "varlen":
        return TorchVarlenBackend()
    if name == "flash_attn":
        return FlashAttnBackend()
    raise ValueError(f"attention backend {name!r} is not available (choose auto, sdpa, varlen, flash_attn)")
