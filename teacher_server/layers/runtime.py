"""The collaborators a model's layers are bound to (``Runtime``) and the base of the layers
that read them (``RuntimeModule``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from teacher_server.attention.base import AttentionBackend
    from teacher_server.kv_pool import KVPool
    from teacher_server.layers.rotary import RotaryEmbedding
    from teacher_server.ops.fused import FusedOps


@dataclass
class Runtime:
    """A model's collaborators, bound once before its first forward (``bind``) and shared by
    all its layers: assigning ``attn`` here switches the backend of every layer."""

    attn: AttentionBackend
    ops: FusedOps  # the stage functions (CUDA kernels / compiled / eager)
    kv: KVPool
    ropes: dict[str, RotaryEmbedding]  # the model's rotary tables by ``rope_key`` (its ``make_ropes``)


class RuntimeModule(nn.Module):
    """A layer whose forward reads the bound ``Runtime`` (``self.rt``)."""

    rt: Runtime | None = None

    def bind(self, rt: Runtime) -> None:
        """Bind rt to this module and every RuntimeModule inside it."""
        for m in self.modules():
            if isinstance(m, RuntimeModule):
                m.rt = rt
