"""Launch pacing: how far the host runs ahead of the GPU while it launches one step, and
the step's timeline on the GPU (CUDA events). The engine makes one pacer per launch and
hands it to the model, which calls ``before_layer`` / ``after_layer`` around each layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class LaunchPacer:
    """Bounded run-ahead within a forward on CUDA: an event is recorded after each layer,
    and before launching layer i the host waits, without the GIL, for layer i - ``ahead``.
    Without it the host fills the GPU's launch queue and then blocks inside a kernel launch
    holding the GIL, which starves the server's event loop and request parsing. ``ahead``
    layers stay queued, so the GPU does not idle.

    ``at_first_wait`` runs once, just before the first wait: the engine completes the
    previous step there (its results are ready by then: the GPU runs steps in launch
    order), so they are not held back until this launch returns. Before each layer the
    pacer also notes whether the GPU has already run out of queued work (the host was
    late): ``idle_gaps`` holds those (last layer's end, next layer's start) event pairs."""

    def __init__(self, ahead: int, at_first_wait: Callable[[], None] | None = None) -> None:
        assert ahead >= 1, f"ahead={ahead}"
        self.ahead = ahead
        self.at_first_wait = at_first_wait
        self.events: list[torch.cuda.Event] = []  # one per layer launched
        self.idle_gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.start: torch.cuda.Event | None = None  # before the step's first kernel
        self.done: torch.cuda.Event | None = None  # after the copies of its results to the host
        self.wait_s = 0.0  # host time spent waiting on this step's own earlier layers
        self.first_wait_s = 0.0  # host time spent in at_first_wait

    # --- around the launch ---------------------------------------------------------------
    def begin(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def end(self) -> None:
        self.done = torch.cuda.Event(enable_timing=True)
        self.done.record()

    # --- around each layer (called by the model) -----------------------------------------
    def before_layer(self, i: int) -> None:
        if i >= self.ahead:
            if self.at_first_wait is not None:
                hook, self.at_first_wait = self.at_first_wait, None
                t = time.perf_counter()
                hook()
                self.first_wait_s += time.perf_counter() - t
            t = time.perf_counter()
            self.events[i - self.ahead].synchronize()
            self.wait_s += time.perf_counter() - t
        if self.events and self.events[-1].query():  # nothing queued: the GPU waits for us
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self.idle_gaps.append((self.events[-1], mark))

    def after_layer(self) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append(ev)

    # --- after the launch ----------------------------------------------------------------
    @property
    def mid(self) -> torch.cuda.Event | None:
        """The event after the middle layer: when the forward is half done."""
        return self.events[len(self.events) // 2] if self.events else None

    def wait_half(self) -> None:
        """Block (without the GIL) until the step's forward is half done."""
        if self.mid is not None:
            self.mid.synchronize()

    def wait_done(self) -> None:
        """Block until the step's results are on the host."""
        if self.done is not None:
            self.done.synchronize()

    def gpu_seconds(self, after: torch.cuda.Event | None) -> tuple[float, float]:
        """(busy, idle) seconds of this step on the GPU, once it is done. Idle: the GPU had
        run out of queued work inside the step, or between ``after`` (the end of the step
        in flight at this launch) and this step's start; busy: the rest of its span."""
        if self.start is None or self.done is None:
            return 0.0, 0.0
        inside = sum(a.elapsed_time(b) for a, b in self.idle_gaps) / 1e3
        busy = self.start.elapsed_time(self.done) / 1e3 - inside
        between = max(0.0, after.elapsed_time(self.start) / 1e3) if after is not None else 0.0
        return busy, inside + between


class Unpaced:
    """The pacer of a launch that is not paced (CPU: the forward runs synchronously, so
    there is nothing to wait for and no GPU timeline). ``at_first_wait`` never runs."""

    ahead = None
    at_first_wait = None
    start = done = mid = None
    wait_s = first_wait_s = 0.0

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def before_layer(self, i: int) -> None:
        pass

    def after_layer(self) -> None:
        pass

    def wait_half(self) -> None:
        pass

    def wait_done(self) -> None:
        pass

    def gpu_seconds(self, after: torch.cuda.Event | None) -> tuple[float, float]:
        return 0.0, 0.0


Pacer = LaunchPacer | Unpaced
