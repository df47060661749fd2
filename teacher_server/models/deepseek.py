"""DeepSeek-V2 and -V3 (DeepSeek-V3/V3.1/R1, Kimi-K2, Moonlight, DeepSeek-V2/V2-Lite):
multi-head latent attention (``models.mla``) and DeepSeekMoE (``layers.deepseek_moe``) in the
Llama decoder; the first ``first_k_dense_replace`` layers have a dense MLP.

Checkpoint names: q_a_proj and kv_a_proj_with_mqa load into the fused ``qkv_a_proj``; the
per-expert tensors and the stacked ones as the other expert families (``models.moe``);
``shared_experts`` into the layer's ungated shared MLP; the multi-token-prediction layers
(``model.layers.<num_hidden_layers + i>``, ``num_nextn_predict_layers`` of them) are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from teacher_server.cache_layout import CacheLayout
from teacher_server.layers.deepseek_moe import DeepseekMoe
from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.parallel import TensorParallel
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from teacher_server.models.mla import LATENT_NORM_EPS, MlaAttention
from teacher_server.models.moe import GROUPED_GEMM, MoeDecoderLayer, MoeModel
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.mla_prep import check_mla_stages


class DeepseekDecoderLayer(MoeDecoderLayer):
    """Latent attention, then DeepSeekMoE (or the dense MLP in the first layers)."""

    def make_mlp(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel, fmt: WeightFormat) -> nn.Module:
        self.sparse = spec.is_moe_layer(layer_id)
        if not self.sparse:
            return LlamaDecoderLayer.make_mlp(self, spec, layer_id, dtype, device, tp, fmt)
        return DeepseekMoe(spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
                           spec.norm_topk_prob, spec.shared_expert_intermediate_size, spec.routing, GROUPED_GEMM,
                           dtype, device, tp, fmt)


class DeepseekForCausalLM(MoeModel, LlamaForCausalLM):
    attention = MlaAttention
    decoder_layer = DeepseekDecoderLayer
    # HF name -> ours, with the part of the (fused or head-split) projection it fills
    stacked = (
        (".q_a_proj.", ".qkv_a_proj.", "q_a"), (".kv_a_proj_with_mqa.", ".qkv_a_proj.", "kv_a"),
        (".q_proj.", ".q_proj.", "q"), (".q_b_proj.", ".q_b_proj.", "q"), (".kv_b_proj.", ".kv_b_proj.", "kv"),
        (".gate_proj.", ".gate_up_proj.", "gate"), (".up_proj.", ".gate_up_proj.", "up"),
    )

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        if self.multi_token_prediction(hf_name):
            return None
        if ".self_attn.q_proj." in hf_name and self.layers[0].self_attn.q_in_a:  # q and kv_a: one GEMM
            hf_name = hf_name.replace(".self_attn.q_proj.", ".self_attn.q_a_proj.")
        return super().checkpoint_param(hf_name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))

    def cache_layout(self) -> CacheLayout:
        """Every layer keeps its 576-wide latent per token (``MlaAttention.cache``)."""
        return CacheLayout(tuple(layer.self_attn.cache() for layer in self.layers), self.dtype)

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None:
        """The shared stages' checks (the fused QKV kernel does not apply: q and the latent
        are rotated by the latent stages), the experts', then the compiled latent stages against
        their eager definitions (a mismatch runs every compiled stage eagerly, as the shared
        checks do)."""
        ops.use_qkv_kernel(False)
        super().warm_up_ops(ops, ropes)
        if not ops.compiled:
            return
        attn, m = self.layers[0].self_attn, self.spec.mla
        table = ropes[attn.rope_key].table
        try:
            check_mla_stages(ops.mla_prep, ops.mla_expand, attn.qkv_a_proj.weight.shape[0], attn.n,
                             m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank,
                             attn.kv_a_layernorm.weight, LATENT_NORM_EPS, table, table.device, self.dtype,
                             q_in_a=attn.q_in_a, views=True)
        except Exception as e:
            ops.eager_stages(e)
