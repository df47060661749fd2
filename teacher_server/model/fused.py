"""Elementwise stages of a decoder layer, written once in plain torch and compiled on CUDA
(``torch.compile``, dynamic shapes: one graph for every token count) so each becomes one
or two fused kernels instead of a chain of full-size passes; SiLU-mul is a hand-written
CUDA kernel (``ops.elementwise``), ~2.5x faster than the compiled one. The CPU runs all
of them eagerly.

The math follows transformers exactly where it rounds: the residual sum is rounded to the
activation dtype before its float32 norm; RMSNorm casts back before the weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from teacher_server.ops.elementwise import qkv_rope, silu_mul, silu_mul_reference

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and not torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # eager CUDA: torch's fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and the next block's input."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qkv_prep(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, n_q: int, n_kv: int, d: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused QKV [T, (n_q + 2 n_kv) d], per-head RMSNorm of q and k (Qwen3), rotary
    on q and k (cos/sin: [T, 1, d/2] float32). Returns contiguous q [T, n_q, d], k, v [T, n_kv, d]."""
    t = qkv.shape[0]
    q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q = q.reshape(t, n_q, d)
    k = k.reshape(t, n_kv, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    return _rotate(q, cos, sin).contiguous(), _rotate(k, cos, sin).contiguous(), v.reshape(t, n_kv, d).contiguous()


class _Guarded:
    """A compiled stage that falls back to its eager version for good the first time
    compilation fails at run time (for example a recompile limit); results stay correct."""

    def __init__(self, compiled: Callable, eager: Callable) -> None:
        self.compiled, self.eager, self.ok = compiled, eager, True

    def __call__(self, *args):  # noqa: ANN002, ANN204
        if self.ok:
            try:
                return self.compiled(*args)
            except Exception as e:
                if not isinstance(e, torch._dynamo.exc.TorchDynamoException) and "inductor" not in type(e).__module__:
                    raise
                log.warning("compiled %s failed at run time (%s); using eager", self.eager.__name__, type(e).__name__)
                self.ok = False
        return self.eager(*args)


class FusedOps:
    """The stage functions, compiled for CUDA or eager. Compilation is checked once on a
    small input against the eager version; any failure falls back to eager (one log line)."""

    def __init__(self, enable_compile: bool) -> None:
        self.add_rms_norm: Callable = add_rms_norm
        self.silu_mul: Callable = silu_mul if enable_compile else silu_mul_reference  # CUDA kernel / eager
        self.qkv_prep: Callable = qkv_prep
        self.rms_norm: Callable = rms_norm
        self.qkv_kernel = enable_compile  # the fused QKV/rotary/KV-write CUDA kernel, where it applies
        self.residual_in_gemm = enable_compile  # residual add in the o/down GEMM epilogue (decoder)
        self.compiled = False
        if enable_compile:
            try:
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                self.add_rms_norm = _Guarded(torch.compile(add_rms_norm, fullgraph=True), add_rms_norm)
                self.qkv_prep = _Guarded(torch.compile(qkv_prep, fullgraph=True), qkv_prep)
                self.rms_norm = _Guarded(torch.compile(rms_norm, fullgraph=True), rms_norm)
                self.compiled = True
            except Exception as e:  # no triton / inductor: the eager path is correct, only slower
                log.warning("torch.compile unavailable (%s); elementwise stages run eagerly", e)
                self.__init__(False)

    def qkv_store(self, qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  n_q: int, n_kv: int, d: int, eps: float, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                  ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """qkv_prep, plus the write of this step's k and v into the KV pool where the
        scheduler asked for it: one CUDA kernel when it can, else the torch stages."""
        if self.qkv_kernel:
            out = qkv_rope(qkv, cs, q_norm, k_norm, eps, n_q, n_kv, d, k_cache, v_cache, ctx.tok_slots)
            if out is not None:
                return out
        half = d // 2
        q, k, v = self.qkv_prep(qkv, cs[:, None, :half], cs[:, None, half:], q_norm, k_norm, n_q, n_kv, d, eps)
        if ctx.write_slots is not None and k_cache is not None:
            k_cache[ctx.write_slots] = k[ctx.write_src]
            v_cache[ctx.write_slots] = v[ctx.write_src]
        return q, k, v

    def fallback(self, err: Exception) -> None:
        log.warning("compiled elementwise stages failed (%s: %s); running them eagerly", type(err).__name__, err)
        self.__init__(False)
