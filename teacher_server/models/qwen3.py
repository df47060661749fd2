"""Qwen3: the Llama decoder with a per-head RMSNorm of q and k before rotary (applied in the
fused QKV stage)."""

from __future__ import annotations

import torch

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.models.llama import LlamaAttention, LlamaForCausalLM
from teacher_server.models.norm import decoder_norm
from teacher_server.models.spec import ModelSpec


class Qwen3Attention(LlamaAttention):
    def __init__(self, spec: ModelSpec, layer_id: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(spec, layer_id, dtype, device, tp, fmt)
        self.q_norm = decoder_norm(spec, spec.head_dim, dtype, device)
        self.k_norm = decoder_norm(spec, spec.head_dim, dtype, device)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.q_norm.weight, self.k_norm.weight


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention = Qwen3Attention
