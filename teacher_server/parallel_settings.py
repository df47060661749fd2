"""The pipeline-parallel setting, a part of ``config.Config`` (a base class of it, through
``teachers.TeacherSettings``: config.py is at its module size limit)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ParallelSettings(BaseModel):
    """How many pipeline stages a replica's model is split over."""

    pipeline_parallel_size: int = Field(
        1, ge=1, description="Split the model's layers over this many pipeline stages (vLLM's flag), each stage "
                             "tensor_parallel_size GPUs of one host: a replica takes pipeline x tensor GPUs. Stage 0 "
                             "embeds, the last stage scores; the hidden states pass between stages once per step. "
                             "On the CPU: gloo processes (tests).")

    def ranks_per_replica(self) -> int:
        """The processes (GPUs) one replica's engine takes: tensor x pipeline parallel size."""
        return getattr(self, "tensor_parallel_size", 1) * self.pipeline_parallel_size
