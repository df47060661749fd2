"""Token embedding and LM head, vocab-parallel: with tp > 1 each rank holds rows
[rank * V / tp, (rank + 1) * V / tp) of the vocabulary. The embedding then masks ids outside
its rows and all-reduces; the LM head scores its vocab shard and the ranks combine per-row
max / sum-exp and the candidates' logits (never the [rows, vocab] logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.linear import copy_checked
from teacher_server.layers.parallel import SINGLE, TensorParallel


class VocabRows(nn.Module):
    """A [V, hidden] weight split over ranks by vocabulary rows (the split point)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.split(vocab, "vocab rows"), hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def shards(self, param: str) -> int:
        return 1

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        n = self.weight.shape[0]
        rows = loaded.narrow(0, self.tp.rank * n, n) if loaded.shape[0] == n * self.tp.size else loaded
        copy_checked(self.weight.data, rows, name)


class VocabEmbedding(VocabRows):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # [T, hidden]; tensor parallel: mask + all-reduce here


class LMHead(VocabRows):
    """The output projection. It has no forward: the scoring stage reads ``weight`` for the
    scored rows only, in float32 row chunks (``engine.scoring``)."""
