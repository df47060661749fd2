"""StepContext: the per-step metadata every layer reads (built once by the model runner,
copied to the device in one transfer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    # Packed query tokens of all sequences in the step.
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    cu_q: torch.Tensor  # [B+1] int32, cumulative query lengths
    cu_k: torch.Tensor  # [B+1] int32, cumulative key lengths (cached prefix + chunk)
    max_q: int
    max_k: int
    q_lens: list[int]  # host copies, used by the per-sequence reference backend
    k_lens: list[int]
    # KV writes into the paged pool: chunk tokens write_src -> pool slots write_slots.
    write_src: torch.Tensor | None  # [W] int64 indices into T
    write_slots: torch.Tensor | None  # [W] int64 slot ids
    # Keys of earlier chunks / cached prefixes, gathered from the pool (None: no prefix in step).
    new_pos: torch.Tensor | None  # [T] int64, where each chunk token sits in the packed keys
    prefix_pos: torch.Tensor | None  # [P] int64, where each gathered prefix token sits
    prefix_slots: torch.Tensor | None  # [P] int64 pool slots to gather
    total_k: int
    # Rows whose hidden state reaches the LM head.
    logits_idx: torch.Tensor  # [R] int64 indices into T

    @property
    def has_prefix(self) -> bool:
        return self.prefix_slots is not None

    @property
    def uniform(self) -> bool:
        """Every sequence has the same length and no earlier keys: a dense batch."""
        return self.prefix_slots is None and len(set(self.q_lens)) == 1
