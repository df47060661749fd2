"""Qwen3.5-MoE (Qwen3.5-35B-A3B and larger): the Qwen3.5 hybrid decoder whose every MLP is
the expert layer (``layers.moe.SparseMoe``: float32 softmax router, top-k renormalised)
with a shared expert behind a sigmoid gate, as Qwen2-MoE's."""

from __future__ import annotations

from teacher_server.models.moe import MoeDecoderLayer, MoeModel
from teacher_server.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer, MoeDecoderLayer):
    """The hybrid mixer (``Qwen3_5DecoderLayer``) with the expert MLP (``MoeDecoderLayer``)."""


class Qwen3_5MoeForCausalLM(MoeModel, Qwen3_5ForCausalLM):
    decoder_layer = Qwen3_5MoeDecoderLayer

    def checkpoint_param(self, hf_name: str) -> tuple[str, str, str | None] | None:
        """Vision-language names are made text-model names first, so the expert mapping of
        ``MoeModel`` sees ``model.layers.N.mlp.*``."""
        if hf_name.startswith("model.language_model."):
            hf_name = "model." + hf_name.removeprefix("model.language_model.")
        return super().checkpoint_param(hf_name)
