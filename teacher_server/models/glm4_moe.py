"""GLM-4.5/4.6 and GLM-4.5-Air (``Glm4MoeForCausalLM``): the Llama decoder with q/k/v biases,
rotary on the first half of each head (neox-style halves of that part, as transformers'
``apply_rotary_pos_emb`` for this family), an optional per-head q/k RMSNorm before rotary
(``use_qk_norm``: GLM-4.5 has it, GLM-4.5-Air not), and DeepSeekMoE
(``layers.deepseek_moe``: DeepSeek-V3's sigmoid router with its score-correction bias and
``routed_scaling_factor``, ungated shared experts) after ``first_k_dense_replace`` dense
layers. The decoder layer is DeepSeek's (``models.deepseek``) over this attention.

Checkpoint names: ``shared_experts`` load into the layer's shared MLP, the experts as the
other expert families; the multi-token-prediction layers (``model.layers.<num_hidden_layers
+ i>``, ``num_nextn_predict_layers`` of them) are skipped.
"""

from __future__ import annotations

import torch

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.deepseek import DeepseekDecoderLayer
from teacher_server.models.llama import LlamaAttention, LlamaForCausalLM
from teacher_server.models.moe import MoeModel, warm_up_experts
from teacher_server.models.norm import decoder_norm
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.partial_rope import check_partial_qk_prep
from teacher_server.ops.qkv_rope import HeadLayout
from teacher_server.step_context import StepContext


class Glm4MoeAttention(LlamaAttention):
    """Fused QKV (with biases where attention_bias), the optional q/k norms, partial rotary,
    attention. q and k are prepared by the ``partial_qk_prep`` stage (compiled where the
    stages are; the fused QKV kernel rotates whole heads)."""

    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, dtype, device, tp, fmt)
        self.rotary_dim = spec.rotary_dim
        if spec.qk_norm:
            self.q_norm = decoder_norm(spec, spec.head_dim, dtype, device)
            self.k_norm = decoder_norm(spec, spec.head_dim, dtype, device)

    def forward(self, h: torch.Tensor, cs: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h: normed input [T, hidden]; cs: the step's rotary rows [T, rotary_dim]."""
        rt, hd = self.rt, self.heads
        t, d = h.shape[0], hd.d
        assert cs.shape[1] == self.rotary_dim, "the rope table must be built at spec.rotary_dim"
        norms = (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else (None, None)
        q, k, v = rt.ops.partial_qk_prep(self.qkv_proj(h), cs, *norms, hd.n_q, hd.n_kv, d, hd.eps)
        rt.kv.store(self.layer_id, k, v, ctx)
        return self.attend(q, k, v, ctx).reshape(t, -1)


class Glm4MoeForCausalLM(MoeModel, LlamaForCausalLM):
    attention = Glm4MoeAttention
    decoder_layer = DeepseekDecoderLayer

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        if self.multi_token_prediction(hf_name):
            return None
        return super().checkpoint_param(hf_name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The compiled stages at the rotary width (the fused QKV kernel is off: partial rotary)
        and the partial-rotary q/k stage at the layer's heads, then the experts' checks: SiLU-mul
        at their width and the grouped GEMM at both shapes."""
        ops.use_qkv_kernel(False)
        attn, s = self.layers[0].self_attn, self.spec
        table = ropes["default"].table
        heads = HeadLayout(attn.heads.n_q, attn.heads.n_kv, table.shape[1], attn.heads.eps)
        dense = next((layer.mlp for layer in self.layers if not layer.sparse), None)
        inter = dense.gate_up_proj.parts["gate"][1] if dense is not None else s.moe_intermediate_size
        ops.warm_up(heads, s.hidden_size, inter, None, None, table, table.device, self.dtype)
        if ops.compiled:  # this family's own compiled stage, at its head layout
            norms = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else (None, None)
            try:
                check_partial_qk_prep(ops.partial_qk_prep, attn.heads, *norms, table, table.device, self.dtype)
            except Exception as e:
                ops.eager_stages(e)
        sparse = next((layer.mlp for layer in self.layers if layer.sparse), None)
        if sparse is not None:
            warm_up_experts(ops, sparse, s.hidden_size, table.device, self.dtype)
