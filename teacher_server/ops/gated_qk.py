"""Qwen3.5's gated attention input stage in one Triton pass (``gated_qk``): from the fused QKV
output [T, 2 n_q d + 2 n_kv d] (q_proj's rows per head [q | gate], then k, then v), q and k
RMS-normed per head and rotated on their first r dims (neox halves of that part), v copied,
each into the layer's buffers; the gate stays a view of the input. One program per block of
tokens and one head: the head's d values read once (the rotation's partner values from the
same cache lines), written once.

It replaces ``ops.partial_rope.gated_qk_prep`` compiled, which inductor made into one
persistent-reduction kernel that took 3.7 ms a call at ~16k tokens on the H100 (about 1/20 of
the memory bandwidth its bytes need): 7% of the Qwen3.5-9B's step. Numerics as the eager
stage: the norm in float32, scaled by a float32 weight and rounded once (a weight in the
model dtype: the normed value rounded, then the product rounded, as ``ops.norm.rms_norm``),
the rotation in float32 from those rounded values, rounded once. ``pick`` is the start-up
check against the eager stage and the timing against the stage it would replace.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernel's arguments take no annotations)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from teacher_server.ops.checks import assert_close, faster
from teacher_server.ops.partial_rope import gated_qk_prep
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.ops.slack import alloc_with_slack
from teacher_server.ops.triton_kernels import lazy

_K: dict[str, Any] = {}
BLOCK_T = 16  # tokens per program (one head each)


def _define(triton, tl) -> dict[str, Any]:
    """The kernel (``triton_kernels.lazy``)."""
    # T differs from step to step: not specialised on (no compile for a new remainder mod 16 while serving)
    @triton.jit(do_not_specialize=["T"])
    def qk_heads(qkv_ptr, s_qkv, cs_ptr, s_cs, qn_ptr, kn_ptr, q_ptr, s_q, k_ptr, s_k, v_ptr, s_v, T, n_q, n_kv, eps,
                 D: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr, W_F32: tl.constexpr):
        # program (token block, head h): h < n_q a q head, then n_kv k heads, then n_kv v heads
        pid_t, h = tl.program_id(0), tl.program_id(1)
        t = pid_t * BT + tl.arange(0, BT)
        tm = t < T
        j = tl.arange(0, D)
        m = tm[:, None]
        row = t.to(tl.int64)
        if h < n_q + n_kv:
            if h < n_q:
                src = qkv_ptr + row[:, None] * s_qkv + h * 2 * D
                w_ptr = qn_ptr
                dst = q_ptr + row[:, None] * s_q + h * D
            else:
                src = qkv_ptr + row[:, None] * s_qkv + (2 * n_q + h - n_q) * D
                w_ptr = kn_ptr
                dst = k_ptr + row[:, None] * s_k + (h - n_q) * D
            rot = j < 2 * HALF
            first = j < HALF
            partner = tl.where(first, j + HALF, tl.where(rot, j - HALF, j))
            x = tl.load(src + j[None, :], mask=m, other=0.0).to(tl.float32)
            xp = tl.load(src + partner[None, :], mask=m, other=0.0).to(tl.float32)  # (the same cache lines)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w = tl.load(w_ptr + j).to(tl.float32)[None, :]
            wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
            if W_F32:  # the normed values scaled, rounded once
                y, yp = x * rstd * w, xp * rstd * wp
            else:  # rounded, then scaled and rounded again (the weight in the model dtype)
                y = (x * rstd).to(q_ptr.dtype.element_ty).to(tl.float32) * w
                yp = (xp * rstd).to(q_ptr.dtype.element_ty).to(tl.float32) * wp
            y = y.to(q_ptr.dtype.element_ty).to(tl.float32)
            yp = yp.to(q_ptr.dtype.element_ty).to(tl.float32)
            c = tl.where(first, j, tl.where(rot, j - HALF, 0))
            cs_row = cs_ptr + row[:, None] * s_cs
            cos = tl.load(cs_row + c[None, :], mask=m & rot[None, :], other=1.0)
            sin = tl.load(cs_row + HALF + c[None, :], mask=m & rot[None, :], other=0.0)
            out = tl.where(first[None, :], y * cos - yp * sin, y * cos + yp * sin)
            out = tl.where(rot[None, :], out, y)
            tl.store(dst + j[None, :], out.to(q_ptr.dtype.element_ty), mask=m)
        else:
            hv = h - n_q - n_kv
            vals = tl.load(qkv_ptr + row[:, None] * s_qkv + (2 * n_q + n_kv + hv) * D + j[None, :], mask=m, other=0.0)
            tl.store(v_ptr + row[:, None] * s_v + hv * D + j[None, :], vals, mask=m)

    return {"qk_heads": qk_heads}


def gated_qk(qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, n_q: int, n_kv: int,
             d: int, eps: float, q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
             block_t: int = BLOCK_T) -> torch.Tensor:
    """``partial_rope.gated_qk_prep`` in one kernel (same arguments, same outputs): q_out [T, n_q,
    d], k_out, v_out [T, n_kv, d] written (rows may be strided, heads packed); returns the gate
    [T, n_q, d], a view of ``qkv``. d a power of two; cs [T, r] float32 (cos | sin), r <= d."""
    kernels = lazy(_K, "gated attention input kernel", _define)
    if "qk_heads" not in kernels:
        raise RuntimeError("the gated attention input kernel needs triton")
    t = qkv.shape[0]
    r = cs.shape[1]
    assert d & (d - 1) == 0 and r % 2 == 0 and r <= d, (d, r)
    assert qkv.stride(1) == 1 and cs.stride(1) == 1 and cs.dtype == torch.float32
    assert qkv.shape[1] == (2 * n_q + 2 * n_kv) * d
    for o, n in ((q_out, n_q), (k_out, n_kv), (v_out, n_kv)):
        assert o.shape == (t, n, d) and o.stride(2) == 1 and o.stride(1) == d and o.dtype == qkv.dtype
    assert q_norm.shape == k_norm.shape == (d,) and q_norm.dtype == k_norm.dtype
    if t:
        grid = (-(-t // block_t), n_q + 2 * n_kv)
        kernels["qk_heads"][grid](qkv, qkv.stride(0), cs, cs.stride(0), q_norm, k_norm, q_out, q_out.stride(0), k_out,
                                  k_out.stride(0), v_out, v_out.stride(0), t, n_q, n_kv, eps, D=d, HALF=r // 2,
                                  BT=block_t, W_F32=q_norm.dtype == torch.float32, num_warps=4)
    return qkv[:, :2 * n_q * d].view(t, n_q, 2 * d)[..., d:]


def _buffers(qkv: torch.Tensor, n: int, heads: HeadLayout) -> list[torch.Tensor]:
    """q, k, v buffers as the layer allocates them (rows inside slack)."""
    return [alloc_with_slack(qkv, n, heads.n_q, heads.d, front=True), alloc_with_slack(qkv, n, heads.n_kv, heads.d),
            alloc_with_slack(qkv, n, heads.n_kv, heads.d)]


def check(heads: HeadLayout, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_sin: torch.Tensor,
          device: torch.device, dtype: torch.dtype, counts: tuple[int, ...] = (1, 40, 3001)) -> None:
    """The kernel against the eager stage at a model's heads, norm weights and rotary table
    (``counts`` tokens each; rotary rows of scattered positions). RuntimeError on a mismatch."""
    n_q, n_kv, d = heads.n_q, heads.n_kv, heads.d
    g = torch.Generator(device="cpu").manual_seed(5)
    for n in counts:
        qkv = (3 * torch.randn(n, (2 * n_q + 2 * n_kv) * d, generator=g)).to(device, dtype)
        cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]
        outs = []
        for stage in (gated_qk, gated_qk_prep):
            bufs = _buffers(qkv, n, heads)
            outs.append((*bufs, stage(qkv, cs, q_norm, k_norm, n_q, n_kv, d, heads.eps, *bufs)))
        for name, got, ref in zip(("q", "k", "v", "gate"), *outs):
            assert_close(f"gated attention input kernel {name} ({n} tokens)", got, ref)


def pick(stage: Callable, heads: HeadLayout, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_sin: torch.Tensor,
         device: torch.device, dtype: torch.dtype, tokens: int = 16384) -> bool:
    """Whether to run the kernel: it checks right (``check``; RuntimeError where not) and runs
    faster than ``stage`` (the stage it replaces: compiled or eager) at ``tokens``."""
    check(heads, q_norm, k_norm, cos_sin, device, dtype)
    qkv = torch.randn(tokens, (2 * heads.n_q + 2 * heads.n_kv) * heads.d, device=device, dtype=dtype)
    cs = cos_sin[torch.arange(tokens, device=device) % cos_sin.shape[0]]
    bufs = _buffers(qkv, tokens, heads)
    args = (qkv, cs, q_norm, k_norm, heads.n_q, heads.n_kv, heads.d, heads.eps, *bufs)
    return faster("gated attention input kernel", lambda: gated_qk(*args), lambda: stage(*args), "the stage",
                  f"{heads.n_q} q heads, {heads.n_kv} kv heads of {heads.d}, {cs.shape[1]} rotary dims")
