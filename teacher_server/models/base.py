"""What the engine sees of a model: the pacing hooks its forward calls around each layer
(``model(ctx, pacer)``) and the model protocol the runner uses (``TeacherModel``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from teacher_server.cache_layout import CacheLayout
    from teacher_server.layers.parallel import TensorParallel
    from teacher_server.layers.pipeline import PipelineStage
    from teacher_server.layers.rotary import RotaryEmbedding
    from teacher_server.layers.runtime import Runtime
    from teacher_server.models.spec import ModelSpec
    from teacher_server.ops.fused import FusedOps
    from teacher_server.step_context import StepContext


class LayerPacer(Protocol):
    """Called around each layer of a forward: before layer i is launched and after it is
    (the engine bounds how far the host runs ahead of the GPU with them)."""

    def before_layer(self, i: int) -> None: ...

    def after_layer(self) -> None: ...


class TeacherModel(Protocol):
    """What the model runner uses of a model (``LlamaForCausalLM`` and its families): its
    spec and tensor-parallel placement, what it caches (``cache_layout``), its rotary tables,
    the start-up checks of the fused stages at its shapes, the LM head for the scoring stage,
    binding its collaborators, and the forward of a step."""

    spec: ModelSpec
    tp: TensorParallel
    stage: PipelineStage  # pipeline parallel: the layers this rank holds (the whole model at size 1)
    last_layer_rows_only: bool  # after the last layer's mixer, only the rows that reach the LM head

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def lm_head(self) -> torch.Tensor | None: ...

    @property
    def lm_vocab_start(self) -> int: ...

    def cache_layout(self) -> CacheLayout: ...

    def make_ropes(self, max_len: int, device: torch.device) -> dict[str, RotaryEmbedding]: ...

    def warm_up_ops(self, ops: FusedOps, ropes: dict[str, RotaryEmbedding]) -> None: ...

    def bind(self, rt: Runtime) -> None: ...

    def __call__(self, ctx: StepContext, pacer: LayerPacer | None = None) -> torch.Tensor: ...
