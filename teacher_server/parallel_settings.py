"""How a model is split over the GPUs of one host, a part of ``config.Config`` (its base
class): the tensor-parallel size, its row parts, how its ranks split the expert layers, and the
pipeline stages."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ParallelSettings(BaseModel):
    tensor_parallel_size: int = Field(
        1, ge=1, description="Split the model over this many GPUs of one host (one worker process per GPU); "
                             "it must divide the attention heads. On the CPU: gloo processes (tests).")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Split the model's layers over this many pipeline stages (vLLM's flag), each stage "
                             "tensor_parallel_size GPUs of one host: a replica takes pipeline x tensor GPUs. Stage 0 "
                             "embeds, the last stage scores; the hidden states pass between stages once per step. "
                             "On the CPU: gloo processes (tests).")
    tp_comm_parts: int = Field(
        1, ge=1, le=16, description="Tensor parallel: make the o and the dense MLPs' down projections in this many "
                                   "row parts, each part's all-reduce running while the next part's GEMM does (parts "
                                   "of at least 1024 rows). 1: one GEMM, then one all-reduce. Deterministic mode uses "
                                   "1.")
    moe_parallel: Literal["tensor", "expert"] = Field(
        "tensor", description="How the tensor_parallel_size ranks split the expert layers: tensor (each expert's "
                              "intermediate dimension, as the dense MLP) or expert (E / size whole experts per rank, "
                              "their GEMMs at full width; the size must divide the expert count; vLLM's "
                              "--enable-expert-parallel). Attention stays tensor parallel (docs/scaling.md).")

    def ranks_per_replica(self) -> int:
        """The processes (GPUs) one replica's engine takes: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
