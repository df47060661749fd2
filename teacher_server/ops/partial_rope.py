"""q/k preparation with rotary on part of each head (GLM-4.5: the first half; Qwen3.5's gated
attention: the first quarter), stages of ``FusedOps`` (compiled into a few fused passes where
the stages are compiled): split the fused QKV output, the optional per-head RMSNorm of q and
k, rotary on their first ``rotary_dim`` dims in neox-style halves of that part (float32 math,
rounded once), the rest copied; and Qwen3.5's output gate, ``o * sigmoid(gate)``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from teacher_server.ops.checks import assert_close
from teacher_server.ops.norm import rms_norm
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.ops.slack import alloc_with_slack


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


def gated_qk_prep(qkv: torch.Tensor, cs: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, n_q: int,
                  n_kv: int, d: int, eps: float, q_out: torch.Tensor, k_out: torch.Tensor,
                  v_out: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's gated attention input from its fused QKV [T, 2 n_q d + 2 n_kv d] (q_proj's rows
    per head [q | gate], then k, v): q and k normed per head and rotated on their first r dims
    (cs [T, r]) into ``q_out`` [T, n_q, d] and ``k_out`` [T, n_kv, d], v into ``v_out`` (the
    layer's buffers with slack rows: ``ops.slack``). Returns the gate [T, n_q, d], a view."""
    t = qkv.shape[0]
    qg, k, v = qkv.split([2 * n_q * d, n_kv * d, n_kv * d], dim=-1)
    qg = qg.view(t, n_q, 2 * d)
    q_out.copy_(rotate_part(rms_norm(qg[..., :d], q_norm, eps), cs))
    k_out.copy_(rotate_part(rms_norm(k.view(t, n_kv, d), k_norm, eps), cs))
    v_out.copy_(v.view(t, n_kv, d))
    return qg[..., d:]


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)`` as [T, H D] (o [T, H, D] in any layout the attention backend
    returns; the gate may be strided): one pass where compiled (which keeps sigmoid(gate) in
    float32 where eager rounds it to the model dtype first)."""
    return (o * torch.sigmoid(gate)).reshape(o.shape[0], -1)


def check_gated_stages(prep: Callable, gate_stage: Callable, heads: HeadLayout, q_norm: torch.Tensor,
                       k_norm: torch.Tensor, cos_sin: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """Start-up check of compiled ``gated_qk_prep`` and ``sigmoid_gate`` against their eager
    definitions at a model's heads, norms and rotary table (two token counts: the static, then
    the dynamic graph; outputs inside buffers with slack, as the layer allocates them).
    Raises RuntimeError on a mismatch."""
    n_q, n_kv, d = heads.n_q, heads.n_kv, heads.d
    for n in (16, 40):
        qkv = torch.randn(n, (2 * n_q + 2 * n_kv) * d, device=device, dtype=dtype)
        cs = cos_sin[(torch.arange(n, device=device) * 37) % cos_sin.shape[0]]
        outs = []
        for stage in (prep, gated_qk_prep):
            bufs = [alloc_with_slack(qkv, n, n_q, d, front=True), alloc_with_slack(qkv, n, n_kv, d),
                    alloc_with_slack(qkv, n, n_kv, d)]
            gate = stage(qkv, cs, q_norm, k_norm, n_q, n_kv, d, heads.eps, *bufs)
            outs.append((*bufs, gate))
        for name, got, ref in zip(("q", "k", "v", "gate"), *outs):
            assert_close(f"compiled gated_qk_prep {name}", got, ref)
        # the attention's output packed, or head-major as a per-sequence backend's transposed view
        for o in (torch.randn(n, n_q, d, device=device, dtype=dtype),
                  torch.randn(n_q, n, d, device=device, dtype=dtype).transpose(0, 1)):
            assert_close("compiled sigmoid_gate", gate_stage(o, outs[1][3]), sigmoid_gate(o, outs[1][3]))


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
