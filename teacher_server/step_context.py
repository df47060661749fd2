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

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(kw_only=True)
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
    # Rows whose hidden state reaches the LM head.
    logits_idx: torch.Tensor  # [R] int64 indices into T
    # KV writes into the paged pool: chunk tokens write_src -> pool slots write_slots.
    # None when the step writes nothing.
    write_src: torch.Tensor | None = None  # [W] int64 indices into T
    write_slots: torch.Tensor | None = None  # [W] int64 slot ids
    tok_slots: torch.Tensor | None = None  # [T] int64: the pool slot of each token's KV, -1 = not written
    # Packed keys of the prefixed sequences ([prefix | chunk] each, in cu_k order), gathered
    # from the pool and this step's keys. None when no sequence in the step is prefixed.
    new_pos: torch.Tensor | None = None  # [Tp] int64, where each prefixed chunk token sits in the packed keys
    prefix_pos: torch.Tensor | None = None  # [P] int64, where each gathered prefix token sits
    prefix_slots: torch.Tensor | None = None  # [P] int64 pool slots to gather
    total_k: int = 0  # packed keys of the prefixed sequences: cu_k[n_prefixed]
    n_prefixed: int = 0  # leading sequences that are prefixed
    tok_prefixed: int = 0  # their query tokens: q[:tok_prefixed]
    # Per prefixed sequence: how many of its leading keys are the very same pool entries as
    # the previous prefixed sequence's (0 for the first). None: no sharing known.
    prefix_shared: list[int] | None = None
    # Per-step scratch of the attention backends: their plans, keyed by (backend, plan key:
    # the window), each made by the first layer that needs it (``attn_plan`` is the latest).
    attn_plans: dict = field(default_factory=dict, repr=False)
    # Per sliding window: this context with the keys its layers read (a prefixed sequence's
    # cached prefix cut to the window before its first query: ``host_step.KvWindow``); a
    # window absent reads every key. The copies share ``attn_plans`` (keyed by window).
    windows: dict[int, StepContext] = field(default_factory=dict, repr=False)
    # Linear-attention state (hybrid models; all None otherwise). Sequence b's linear layers
    # start from state slot state_in[b] (0: the zero state, the sequence starts at position
    # 0); after the step, the end state of sequence state_keep[j] goes to slot state_out[j].
    # A state_out may equal the state_in of the same sequence (a chunked sequence carries its
    # state in place): a layer reads every initial state before it writes any end state.
    state_in: torch.Tensor | None = None  # [B] int64 slots
    state_keep: torch.Tensor | None = None  # [S] int64 indices into the step's sequences; None when S == 0
    state_out: torch.Tensor | None = None  # [S] int64 slots (never 0)
    state_in_host: list[int] | None = None  # host copies (plans are made on the host, no device sync)
    state_keep_host: list[int] | None = None
    # Per-step scratch of the linear layers, made on first use.
    linear_plan: Any = field(default=None, repr=False)

    @property
    def has_prefix(self) -> bool:
        return self.n_prefixed > 0

    def for_window(self, window: int | None) -> StepContext:
        """The context a layer of ``window`` (None: full attention) reads its keys by."""
        return self if window is None else self.windows.get(window, self)

    @property
    def attn_plan(self) -> Any:
        """The attention plan made last in this step (None before the first); assigning None
        drops every plan, so the next layer of each kind plans again."""
        return next(reversed(self.attn_plans.values()), None)

    @attn_plan.setter
    def attn_plan(self, plan: Any) -> None:
        assert plan is None, "plans are kept by key in attn_plans; only None (drop them all) is assigned here"
        self.attn_plans.clear()

