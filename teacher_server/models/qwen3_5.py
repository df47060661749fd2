"""Qwen3.5 (dense): the hybrid decoder. Each layer's mixer is either a Gated DeltaNet
(``models.gated_delta``: a convolution and a recurrent state per sequence, kept in the KV
pool's state slots) or gated full attention (paged KV); the MLP is Llama's. Every decoder
RMSNorm (input, post-attention, final, q/k) scales by ``(1 + w)`` in float32.

Gated full attention: ``q_proj`` makes ``[q | gate]`` per head; q and k are RMS-normed per
head, rotated on their first ``rotary_dim`` dims (neox-style; the multimodal rope of the
checkpoints is plain rope for token ids), attended, and the output is scaled by
``sigmoid(gate)``. Its q/k preparation is one Triton pass on CUDA where the warm-up finds it
right and faster (``ops.gated_qk``), else a compiled stage (the fused QKV kernel rotates whole
heads).

The ``...ForConditionalGeneration`` checkpoints are read for their text model
(``model.language_model.*``); vision (``model.visual.*``) and multi-token-prediction
(``mtp.*``) tensors are skipped.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from teacher_server.cache_layout import LinearStateLayout
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.gated_delta import GatedDeltaNet
from teacher_server.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from teacher_server.models.qwen3 import Qwen3Attention
from teacher_server.models.spec import ModelSpec
from teacher_server.ops import gated_qk
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.gated_delta import check_fla
from teacher_server.ops.partial_rope import check_gated_stages
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.ops.slack import alloc_with_slack
from teacher_server.step_context import StepContext

_SKIPPED = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.)")
# Names of a linear layer's own parameters (not of a projection or norm module).
_LINEAR_OWN = {"conv1d.weight": "conv_weight", "A_log": "A_log", "dt_bias": "dt_bias"}
_LINEAR_OWN_RE = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(conv1d\.weight|A_log|dt_bias)$")


class Qwen3_5Attention(Qwen3Attention):
    """Gated full attention: returns ``attn(q, k, v) * sigmoid(gate)`` [T, heads * head_dim]
    (``o_proj`` is applied by the decoder layer). Qwen3's layer (q/k norms, here zero-centred
    as the spec says) with q_proj making ``[q | gate]`` per head, and rotary on the first
    ``rotary_dim`` dims of each head."""

    q_rows_per_head = 2

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, dtype, device, tp, fmt)
        self.rotary_dim = spec.rotary_dim

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h: normed input [T, hidden]; cs: the step's rotary rows [T, rotary_dim]."""
        rt, hd = self.rt, self.heads
        t, d = h.shape[0], hd.d
        # (an odd rotary width rotates one more dim, as transformers does: the table has a column
        # pair per frequency)
        assert cs.shape[1] == self.rotary_dim + self.rotary_dim % 2, "the rope table must be built at spec.rotary_dim"
        # q, k, v with slack rows (the cuDNN backend pads into them without copies), written by one
        # stage (compiled: q/k norms, partial rotary and the split in a fused pass or two)
        q, k, v = (alloc_with_slack(h, t, hd.n_q, d, front=True), alloc_with_slack(h, t, hd.n_kv, d),
                   alloc_with_slack(h, t, hd.n_kv, d))
        prep = gated_qk.gated_qk if rt.ops.gated_qk_kernel else rt.ops.gated_qk_prep
        gate = prep(self.qkv_proj(h), cs, self.q_norm.weight, self.k_norm.weight, hd.n_q, hd.n_kv, d, hd.eps, q, k, v)
        rt.kv.store(self.layer_id, k, v, ctx)
        return rt.ops.sigmoid_gate(self.attend(q, k, v, ctx), gate)  # [T, heads * head_dim]


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    """The mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn`` (gated attention), as
    ``spec.layer_types`` says; norms are zero-centred (``decoder_norm``: the spec says so)."""

    linear_mixer: type[nn.Module] = GatedDeltaNet

    def __init__(self, spec: ModelSpec, layer_id: int, attention: type[nn.Module], dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        linear = spec.is_linear_layer(layer_id)
        super().__init__(spec, layer_id, self.linear_mixer if linear else attention, dtype, device, tp, fmt)
        self.linear = linear
        if linear:  # the checkpoint's name for it
            self.linear_attn = self.self_attn
            del self.self_attn

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.linear else self.self_attn


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """The Qwen3.5 decoder; ``linear_state_layout`` says what state its linear layers keep."""

    attention = Qwen3_5Attention
    decoder_layer = Qwen3_5DecoderLayer
    stacked = LlamaForCausalLM.stacked + (
        (".in_proj_qkv.", ".in_proj.", "qkv"), (".in_proj_z.", ".in_proj.", "z"),
        (".in_proj_b.", ".in_proj.", "b"), (".in_proj_a.", ".in_proj.", "a"),
        (".linear_attn.out_proj.", ".linear_attn.o_proj.", None),
    )

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        """Text-model names of both checkpoint kinds; a linear layer's convolution weight,
        ``A_log`` and ``dt_bias`` belong to the layer itself."""
        if _SKIPPED.match(hf_name):
            return None
        if hf_name.startswith("model.language_model."):
            hf_name = "model." + hf_name.removeprefix("model.language_model.")
        m = _LINEAR_OWN_RE.match(hf_name)
        if m:
            return f"layers.{m.group(1)}.linear_attn", _LINEAR_OWN[m.group(2)], None
        return super().checkpoint_param(hf_name)

    def linear_state_layout(self) -> LinearStateLayout | None:
        """Per slot and linear layer: the convolution state [conv_dim, kernel] (fla-core's
        layout: the last ``kernel`` q/k/v in-projection rows, newest last) in the model dtype,
        and the recurrent state [value heads, key head dim, value head dim] float32. None
        when every layer this rank holds is full attention (no state to keep)."""
        s = self.spec
        linear = [layer for layer in self.layers if layer.linear]  # this pipeline stage's
        if not linear:
            return None
        mixer = linear[0].linear_attn  # this rank's heads and channels
        return LinearStateLayout(layers=tuple(layer.linear_attn.layer_id for layer in linear),
                                 conv_shape=(mixer.conv_dim, s.linear_conv_kernel_dim),
                                 rec_shape=(mixer.nv, s.linear_key_head_dim, s.linear_value_head_dim),
                                 conv_dtype=self.dtype)

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The compiled stages and SiLU-mul at this model's shapes. The fused QKV kernel is
        not used here (partial rotary, the output gate): it is switched off rather than
        checked; the compiled q/k stage is checked at the rotary width of the rope table.
        On CUDA, fla-core's kernels are checked (and autotuned) at the linear layers' shapes, and
        so is the fused input stage of those layers."""
        ops.use_qkv_kernel(False)
        s = self.spec
        rope = ropes[self.attention.rope_key]
        # this rank's heads (a pipeline stage of linear layers only: as an attention layer would hold them)
        n_q, n_kv = self.tp.heads(s.num_heads, s.num_kv_heads)
        heads = HeadLayout(n_q, n_kv, rope.table.shape[1], s.rms_norm_eps)
        dense = next((layer.mlp for layer in self.layers if hasattr(layer.mlp, "gate_up_proj")), None)
        inter = dense.gate_up_proj.parts["gate"][1] if dense is not None else self.spec.intermediate_size
        mixer = next((layer.linear_attn for layer in self.layers if layer.linear), None)  # this rank's shares
        if mixer is not None:  # the gated output norm of the linear layers, compiled as they call it
            ops.expect_linear_layers(mixer.gated_norm_shape(), mixer.heads_shape())
        ops.warm_up(heads, self.spec.hidden_size, inter, None, None, rope.table, rope.table.device, self.dtype)
        attn = next((layer.self_attn for layer in self.layers if not layer.linear), None)
        if attn is not None and ops.compiled:  # the gated attention's input stage and output gate
            try:
                check_gated_stages(ops.gated_qk_prep, ops.sigmoid_gate, attn.heads, attn.q_norm.weight,
                                   attn.k_norm.weight, rope.table, rope.table.device, self.dtype)
            except Exception as e:
                ops.eager_stages(e)
        if attn is not None:  # the gated attention's input stage as one kernel, against the stage it would replace
            args = (attn.heads, attn.q_norm.weight, attn.k_norm.weight, rope.table, rope.table.device, self.dtype)
            ops.pick_gated_qk(lambda: gated_qk.pick(ops.gated_qk_prep, *args), rope.table.device)
        if mixer is not None:
            check_fla(mixer.nk, mixer.nv, s.linear_key_head_dim, s.linear_value_head_dim, mixer.conv_dim,
                      s.linear_conv_kernel_dim, rope.table.device, self.dtype)
            ops.check_conv_kernel(mixer.nk, s.linear_key_head_dim, mixer.nv, s.linear_value_head_dim,
                                  s.linear_conv_kernel_dim, rope.table.device, self.dtype)
