"""Gemma 3 (text): the Llama decoder with Gemma's changes.

- Layers are local (a sliding window of ``sliding_window`` keys, rotary base
  ``rope_local_base_freq``, plain rope) or global (full attention, ``rope_theta`` with the
  config's scaling, linear x8 in the 4B-27B checkpoints), as ``spec.layer_types`` says: five
  local to one global in the released models. Each kind has its own rotary table
  (``rope_key``); both run on the fast attention backends, which plan a step per window.
- q and k are RMS-normed per head before rotary; the softmax scale is
  ``query_pre_attn_scalar ** -0.5``.
- Four norms per layer: input, post-attention (on the o projection's output, before the
  residual add), pre-feed-forward and post-feed-forward (on the down projection's output).
  Every norm scales by ``(1 + w)`` in float32 (``ZeroCenteredRMSNorm``).
- The MLP is GELU(tanh)-gated; the embedding rows are scaled by sqrt(hidden) rounded to the
  model dtype (as transformers multiplies); the LM head is the embedding (tied), its logits
  soft-capped where ``final_logit_softcapping`` is set.

``Gemma3ForConditionalGeneration`` checkpoints are read for their text model: the hub's
``language_model.model.*`` / ``language_model.lm_head.*`` and transformers 5's
``model.language_model.*`` names; the vision tower and the projector are skipped.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from teacher_server.cache_layout import AttentionParams
from teacher_server.layers.embedding import VocabEmbedding, VocabRows
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from teacher_server.models.norm import decoder_norm
from teacher_server.models.qwen3 import Qwen3Attention
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.checks import assert_close
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.gelu_mul import gelu_tanh_mul
from teacher_server.ops.norm import norm_add, norm_add_rms_norm
from teacher_server.step_context import StepContext

_SKIPPED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# the text model's names in the vision-language checkpoints -> Gemma3ForCausalLM's
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


class ScaledEmbedding(VocabEmbedding):
    """The embedding rows times sqrt(hidden), the factor rounded to the model dtype first
    (transformers multiplies by ``embed_scale.to(weight.dtype)``: 73.5 in bf16 for 5376)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(vocab, hidden, dtype, device, tp, fmt)
        self.scale = float(torch.tensor(hidden ** 0.5, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class SoftcappedLogits:
    """The logits layer with Gemma's final soft-cap, ``cap * tanh(logits / cap)`` in float32,
    in place (elementwise: a rank's vocab shard is capped alone). Everything else is the
    wrapped layer's."""

    def __init__(self, rows: VocabRows, cap: float) -> None:
        self.inner, self.cap = rows, cap

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(h).div_(self.cap).tanh_().mul_(self.cap)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (per-head q/k norms, here ``(1 + w)``) with Gemma's softmax scale,
    and the local layers' own rotary table."""

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, dtype, device, tp, fmt)
        window = spec.layer_window(layer_id)
        self.params = AttentionParams(spec.gemma.query_pre_attn_scalar ** -0.5, window)
        self.rope_key = "default" if window is None else "local"


class GeluTanhMLP(LlamaMLP):
    """Llama's MLP with gelu_tanh(gate) * up in place of SiLU-mul: [T, hidden] -> [T,
    intermediate]; the gate/up GEMM and the activation in one kernel where it runs (Hopper,
    plain weights: ``FusedOps.gate_up_act``), else the GEMM then ``FusedOps.gelu_tanh_mul``
    (compiled where the stages are). The down projection is applied by the decoder layer."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = self.gate_up_proj
        w = p.fmt.dense(p)
        a = self.rt.ops.gate_up_act(h, w, "gelu_tanh") if w is not None and p.bias is None else None
        return a if a is not None else self.rt.ops.gelu_tanh_mul(p(h))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """x + post_attn_norm(o(attn(in_norm(x)))), then + post_ff_norm(down(mlp(pre_ff_norm(.)))).
    The post norms sit between each projection and its residual add, so the add is not made
    in the GEMM's epilogue here (``residual_in_gemm`` does not apply)."""

    def __init__(self, spec: ModelSpec, layer_id: int, attention: type[nn.Module], dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, attention, dtype, device, tp, fmt)
        self.pre_feedforward_layernorm = decoder_norm(spec, spec.hidden_size, dtype, device)
        self.post_feedforward_layernorm = decoder_norm(spec, spec.hidden_size, dtype, device)

    def make_mlp(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel, fmt: WeightFormat) -> nn.Module:
        return GeluTanhMLP(spec, dtype, device, tp, fmt)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``LlamaDecoderLayer.forward`` (``keep``: the rows past the mixer)."""
        ops, attn = self.rt.ops, self.self_attn
        a = attn(h, cs, ctx)  # [T, q width]
        if keep is not None:
            x, a = x[keep], a[keep]
        # each: post-norm of the block's output, residual add, the next block's input norm (one eps per model)
        eps = self.pre_feedforward_layernorm.eps
        x, h = ops.norm_add_rms_norm(x, attn.o_proj(a), self.post_attention_layernorm.weight,
                                     self.pre_feedforward_layernorm.weight, eps)
        out, post = self.mlp.down_proj(self.mlp(h)), self.post_feedforward_layernorm.weight
        if self.next_norm is None:  # a pipeline stage's last layer before the last stage: no next norm here
            return ops.norm_add(x, out, post, eps), None
        return ops.norm_add_rms_norm(x, out, post, self.next_norm.weight, eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    attention = Gemma3Attention
    decoder_layer = Gemma3DecoderLayer
    embedding = ScaledEmbedding

    @property
    def logits_layer(self) -> VocabRows | None:
        rows = super().logits_layer
        if rows is None:  # (a pipeline stage before the last)
            return None
        cap = self.spec.gemma.final_logit_softcapping
        return rows if cap is None else SoftcappedLogits(rows, cap)

    @property
    def lm_head(self) -> torch.Tensor | None:
        head = LlamaForCausalLM.logits_layer.fget(self)  # the plain weight, before any soft-cap
        return head.fmt.dense(head)

    def make_ropes(self, max_len: int, device: torch.device) -> dict[str, RotaryEmbedding]:
        """The global layers' table (``rope_theta`` and its scaling) and the local layers'
        (``rope_local_base_freq``, unscaled)."""
        s = self.spec
        return {"default": RotaryEmbedding(s.rotary_dim, s.rope_theta, s.rope_scaling, s.max_position_embeddings,
                                           max_len, device),
                "local": RotaryEmbedding(s.rotary_dim, s.gemma.local_rope_theta, {"rope_type": "default"},
                                         s.max_position_embeddings, max_len, device)}

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        if _SKIPPED.match(hf_name):
            return None
        for theirs, ours in _TEXT_PREFIXES:
            if hf_name.startswith(theirs):
                hf_name = ours + hf_name.removeprefix(theirs)
                break
        return super().checkpoint_param(hf_name)

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The shared stages' checks; the fused QKV kernel is off (it reads q/k norm weights in
        the model dtype; Gemma's are float32 ``1 + w``): the compiled q/k stage runs instead."""
        ops.use_qkv_kernel(False)
        ops.refuse("gate_up_kernel")  # (the SiLU variant: Gemma's MLP takes the GELU one, checked below)
        super().warm_up_ops(ops, ropes)
        mlp = self.layers[0].mlp  # the fused gate/up kernel with gelu_tanh, at this rank's width
        ops.check_gate_up(self.spec.hidden_size, mlp.down_proj.weight.shape[1], mlp.down_proj.weight.device,
                          self.dtype, "gelu_tanh")
        if ops.compiled:  # this family's own compiled stages, at its widths (a failure: every stage eager)
            table = ropes["default"].table
            try:
                check_gemma_stages(ops, self.spec.hidden_size, self.layers[0].mlp.down_proj.weight.shape[1],
                                   self.spec.rms_norm_eps, table.device, self.dtype, not self.stage.last)
            except Exception as e:
                ops.eager_stages(e)


def check_gemma_stages(ops: FusedOps, hidden: int, inter: int, eps: float, device: torch.device,
                       dtype: torch.dtype, stage_end: bool = False) -> None:
    """The compiled post-norm/add/norm and GELU-mul stages against their eager definitions at two
    token counts (the static, then the dynamic graph), and the post-norm/add alone where the
    model is a pipeline stage before the last (``stage_end``); RuntimeError on a mismatch."""
    for n in (16, 40):
        x = torch.randn(n, hidden, device=device, dtype=dtype)
        w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=torch.float32)  # (1 + w) in float32
        gu = torch.randn(n, 2 * inter, device=device, dtype=dtype)
        args = (x, x.flip(0), w, w.flip(0), eps)
        pairs = [(ops.norm_add_rms_norm(*args), norm_add_rms_norm(*args)),
                 ((ops.gelu_tanh_mul(gu),), (gelu_tanh_mul(gu),))]
        if stage_end:
            pairs.append(((ops.norm_add(x, x.flip(0), w, eps),), (norm_add(x, x.flip(0), w, eps),)))
        for got, ref in pairs:
            for g, r in zip(got, ref):
                assert_close("compiled Gemma stage", g, r)
