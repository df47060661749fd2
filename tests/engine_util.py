"""Test helpers for the engine: hooks around its model's forward (fault injection, slow
steps, logs) and stand-ins for CUDA events, so the launch pacer runs on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from teacher_server.engine.engine import Engine
from teacher_server.step_context import StepContext


def around_forward(eng: Engine, before: Callable[[StepContext], None] | None = None,
                   after: Callable[[StepContext], None] | None = None) -> None:
    """Call ``before(ctx)`` / ``after(ctx)`` around every forward of the engine's model."""
    orig = eng.model.forward

    def forward(ctx: StepContext, *args: object, **kw: object) -> torch.Tensor:
        if before is not None:
            before(ctx)
        out = orig(ctx, *args, **kw)
        if after is not None:
            after(ctx)
        return out

    eng.model.forward = forward


def fail_on_token(eng: Engine, token: int, exc: Callable[[], BaseException], delay_s: float = 0.0) -> None:
    """Every step holding ``token`` raises ``exc()`` at the start of its forward; every step
    first sleeps ``delay_s`` (long steps, so messages pile up meanwhile)."""
    import time

    def check(ctx: StepContext) -> None:
        if delay_s:
            time.sleep(delay_s)
        if token in ctx.input_ids.tolist():
            raise exc()

    around_forward(eng, before=check)


class FakeEvents:
    """A stand-in for ``torch.cuda.Event`` (monkeypatch it in): records and waits go to
    ``log`` as ("record" | "sync", event); the GPU is always behind (``query`` is False)
    and every span is 1 ms."""

    def __init__(self, log: list) -> None:
        self.log = log
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                pass

            def record(self) -> None:
                outer.log.append(("record", self))

            def synchronize(self) -> None:
                outer.log.append(("sync", self))

            def query(self) -> bool:
                return False

            def elapsed_time(self, other: Event) -> float:
                return 1.0

        self.Event = Event
