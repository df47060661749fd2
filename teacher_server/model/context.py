"""StepContext: the per-step metadata every layer reads (built once by the model runner,
copied to the device in one transfer).

Sequence order in a step: sequences whose queries follow earlier keys (a cached prefix or
earlier chunks: "prefixed") come first, then "fresh" sequences (keys = their own queries),
longest first. Attention backends rely on it: each part is one contiguous token range.
Prefixed sequences are ordered by the pool blocks they read, so those sharing leading KV
blocks (a GRPO group's responses after their cached prompt) sit next to each other,
longest first among equals (``prefix_shared``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class LaunchPacer:
    """Bounded run-ahead within a forward on CUDA: an event is recorded after each layer,
    and before launching layer i the host waits, without the GIL, for layer i - ``ahead``.
    Without it the host fills the GPU's launch queue and then blocks inside a kernel launch
    holding the GIL, which starves the server's event loop and request parsing. ``ahead``
    layers stay queued, so the GPU does not idle.

    ``on_first_wait`` runs once, just before the first wait: the engine completes the
    previous step there (its results are ready by then), so they are not held back until
    this launch returns. Before each layer the pacer also notes whether the GPU has already
    run out of queued work (the host was late): ``idle_gaps`` holds those (last layer's
    end, next layer's start) event pairs."""

    def __init__(self, ahead: int, on_first_wait: Callable[[], None] | None = None) -> None:
        self.ahead = ahead
        self.on_first_wait = on_first_wait
        self.events: list[torch.cuda.Event] = []
        self.idle_gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wait_s = 0.0  # host time spent waiting here
        self.hook_s = 0.0  # host time spent in on_first_wait

    def before_layer(self, i: int) -> None:
        if i >= self.ahead:
            if self.on_first_wait is not None:
                hook, self.on_first_wait = self.on_first_wait, None
                t = time.perf_counter()
                hook()
                self.hook_s += time.perf_counter() - t
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

    @property
    def mid(self) -> torch.cuda.Event | None:
        """The event after the middle layer: when the forward is half done."""
        return self.events[len(self.events) // 2] if self.events else None


@dataclass
class StepContext:
    # Packed query tokens of all sequences in the step.
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    cu_q: torch.Tensor  # [B+1] int32, cumulative query lengths
    cu_k: torch.Tensor  # [B+1] int32, cumulative key lengths (prefix + chunk; = query length when fresh)
    max_q: int
    max_k: int
    q_lens: list[int]  # host copies: attention plans are made on the host, no device sync
    k_lens: list[int]
    # KV writes into the paged pool: chunk tokens write_src -> pool slots write_slots.
    write_src: torch.Tensor | None  # [W] int64 indices into T
    write_slots: torch.Tensor | None  # [W] int64 slot ids
    # Packed keys of the prefixed sequences ([prefix | chunk] each, in cu_k order), gathered
    # from the pool and this step's keys. None when no sequence in the step is prefixed.
    new_pos: torch.Tensor | None  # [Tp] int64, where each prefixed chunk token sits in the packed keys
    prefix_pos: torch.Tensor | None  # [P] int64, where each gathered prefix token sits
    prefix_slots: torch.Tensor | None  # [P] int64 pool slots to gather
    total_k: int  # packed keys of the prefixed sequences: cu_k[n_prefixed]
    # Rows whose hidden state reaches the LM head.
    logits_idx: torch.Tensor  # [R] int64 indices into T
    n_prefixed: int = 0  # leading sequences that are prefixed
    tok_prefixed: int = 0  # their query tokens: q[:tok_prefixed]
    tok_slots: torch.Tensor | None = None  # [T] int64: the pool slot of each token's KV, -1 = not written
    # Per prefixed sequence: how many of its leading keys are the very same pool entries as
    # the previous prefixed sequence's (0 for the first). None: no sharing known.
    prefix_shared: list[int] | None = None
    pacer: LaunchPacer | None = None  # CUDA: bounds how far the host runs ahead of the GPU
    # Per-step scratch of the attention backend (its plan), made on first use by layer 0.
    attn_plan: Any = field(default=None, repr=False)

    @property
    def has_prefix(self) -> bool:
        return self.n_prefixed > 0
