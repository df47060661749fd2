"""Our own decoder implementation for the Llama / Mistral / Qwen2 / Qwen3 families.

Weights are fused (QKV, gate/up). The forward takes packed varlen tokens and a
StepContext; KV of the step's tokens is written to the paged pool where the scheduler
asked for it, and keys of earlier chunks / cached prefixes are gathered from it.
Only the hidden rows listed in ``ctx.logits_idx`` are returned (final-normed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.model.attention import AttentionBackend
from teacher_server.step_context import LayerPacer, StepContext
from teacher_server.model.fused import FusedOps
from teacher_server.model.spec import ModelSpec
from teacher_server.ops.elementwise import alloc_with_slack


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        kw = {"dtype": dtype, "device": device}
        self.spec = spec
        self.input_norm = nn.Parameter(torch.empty(h, **kw), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(h, **kw), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty(spec.q_size + 2 * spec.kv_size, h, **kw), requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.empty(spec.q_size + 2 * spec.kv_size, **kw), requires_grad=False)
                         if spec.attention_bias else None)
        self.o_proj = nn.Parameter(torch.empty(h, spec.q_size, **kw), requires_grad=False)
        self.q_norm = nn.Parameter(torch.empty(d, **kw), requires_grad=False) if spec.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(d, **kw), requires_grad=False) if spec.qk_norm else None
        self.gate_up_proj = nn.Parameter(torch.empty(2 * spec.intermediate_size, h, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(h, spec.intermediate_size, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor, next_norm: torch.Tensor, cs: torch.Tensor,
                ctx: StepContext, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                attn: AttentionBackend, ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x: residual stream [T, hidden]; h: this layer's normed input. Returns the new
        residual stream and the next layer's normed input (normed with ``next_norm``)."""
        spec = self.spec
        eps, d = spec.rms_norm_eps, spec.head_dim
        t = x.shape[0]
        # --- attention ---
        qkv = F.linear(h, self.qkv_proj, self.qkv_bias)  # [T, q + 2kv]
        q, k, v = ops.qkv_store(qkv, cs, self.q_norm, self.k_norm, spec.num_heads, spec.num_kv_heads, d, eps,
                                k_cache, v_cache, ctx)
        kp = vp = None
        if ctx.has_prefix:
            # Packed [cached prefix | chunk] keys of the prefixed sequences (the first tp tokens).
            tp = ctx.tok_prefixed
            kp = alloc_with_slack(k, ctx.total_k, spec.num_kv_heads, d)
            vp = alloc_with_slack(v, ctx.total_k, spec.num_kv_heads, d)
            kp[ctx.new_pos] = k[:tp]
            vp[ctx.new_pos] = v[:tp]
            kp[ctx.prefix_pos] = k_cache[ctx.prefix_slots]
            vp[ctx.prefix_pos] = v_cache[ctx.prefix_slots]
        o = attn(q, k, v, kp, vp, ctx, d ** -0.5, spec.sliding_window)  # [T, Hq, D]
        x, h = self._residual(x, o.reshape(t, spec.q_size), self.o_proj, self.post_attn_norm, eps, ops)
        # --- MLP ---
        return self._residual(x, ops.silu_mul(F.linear(h, self.gate_up_proj)), self.down_proj, next_norm, eps, ops)

    @staticmethod
    def _residual(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, eps: float,
                  ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x + a @ w.T (the new residual stream) and its RMSNorm. With ``residual_in_gemm`` the
        sum is made in the GEMM's epilogue, in place (x is this step's own activation), and
        rounded once, instead of rounding a @ w.T and then the sum; it saves a full pass over
        [T, hidden] per call."""
        if ops.residual_in_gemm:
            x = x.addmm_(a, w.t())
            return x, ops.rms_norm(x, norm, eps)
        return ops.add_rms_norm(x, F.linear(a, w), norm, eps)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, tied: bool) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.spec = spec
        self.tied = tied
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, device) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.hidden_size, **kw), requires_grad=False)
        self.lm_head = (self.embed if tied else
                        nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, **kw), requires_grad=False))

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cos_sin: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                attn: AttentionBackend, ops: FusedOps, pacer: LayerPacer | None = None) -> torch.Tensor:
        """Returns the final-normed hidden states of the rows in ctx.logits_idx: [R, hidden].
        ``pacer`` (CUDA) is told before and after each layer."""
        eps = self.spec.rms_norm_eps
        x = F.embedding(ctx.input_ids, self.embed)  # [T, hidden]
        cs = cos_sin[ctx.positions]  # [T, D] float32: cos | sin halves
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            if pacer is not None:
                pacer.before_layer(i)
            kc, vc = kv_caches[i] if kv_caches else (None, None)
            next_norm = self.layers[i + 1].input_norm if i + 1 < n else self.norm
            x, h = layer(x, h, next_norm, cs, ctx, kc, vc, attn, ops)
            if pacer is not None:
                pacer.after_layer()
        return h[ctx.logits_idx]
