"""The pacing hooks a model's forward calls around each layer (``model(ctx, pacer)``)."""

from __future__ import annotations

from typing import Protocol


class LayerPacer(Protocol):
    """Called around each layer of a forward: before layer i is launched and after it is
    (the engine bounds how far the host runs ahead of the GPU with them)."""

    def before_layer(self, i: int) -> None: ...

    def after_layer(self) -> None: ...
