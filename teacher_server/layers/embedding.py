"""Token embedding and LM head, vocab-parallel: with tp > 1 each rank holds the rows
``TensorParallel.vocab(V)`` of the vocabulary (uneven shards when tp does not divide V: no
padding rows, so nothing padded can win a max or count in a sum-exp). The embedding masks
ids outside its rows and all-reduces; the LM head scores its vocab shard and the ranks combine
per-row max / sum-exp and the candidates' logits (``engine.vocab_parallel``), never the
[rows, vocab] logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.linear import Slice, copy_checked, take
from teacher_server.layers.parallel import SINGLE, TensorParallel


class VocabRows(nn.Module):
    """A [V, hidden] weight split over ranks by vocabulary rows: this rank holds ids
    [vocab_start, vocab_start + rows)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, n = tp.vocab(vocab)
        self.weight = nn.Parameter(torch.empty(n, hidden, dtype=dtype, device=device), requires_grad=False)

    def shards(self, param: str) -> int:
        return 1

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return (0, self.vocab_start, self.weight.shape[0]) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(self.weight.data, take(loaded, self.checkpoint_slice(param, part)), name)


class VocabEmbedding(VocabRows):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T] ids another rank holds
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)


class LMHead(VocabRows):
    """The output projection. It has no forward: the scoring stage reads ``weight`` for the
    scored rows only, in float32 row chunks (``engine.scoring``)."""
