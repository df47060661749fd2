"""Token embedding and LM head, vocab-parallel: with tp > 1 each rank holds the rows
``TensorParallel.vocab(V)`` of the vocabulary (uneven shards when tp does not divide V: no
padding rows, so nothing padded can win a max or count in a sum-exp). The embedding masks
ids outside its rows and all-reduces; the LM head scores its vocab shard and the ranks combine
per-row max / sum-exp and the candidates' logits (``engine.vocab_parallel``), never the
[rows, vocab] logits. Both hold their [V, hidden] weight through their weight format
(``layers.formats``; the embedding's must hold plain rows to look up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teacher_server.layers.formats.base import WeightFormat
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import Slice, copy_checked, take
from teacher_server.layers.parallel import SINGLE, TensorParallel

_MM_OUT_DTYPE: bool | None = None  # does torch.mm(..., out_dtype=float32) work here?


def lm_head_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[r, H] x [V, H]^T -> [r, V] float32, accumulated and stored in float32 (no bf16
    rounding of logits: it costs ~0.06 nats at logit 16)."""
    global _MM_OUT_DTYPE
    if w.dtype == torch.float32:
        return h.float() @ w.t()
    if h.is_cuda and _MM_OUT_DTYPE is not False:
        try:
            out = torch.mm(h, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    return h.float() @ w.float().t()


class VocabRows(nn.Module):
    """A [V, hidden] weight split over ranks by vocabulary rows: this rank holds ids
    [vocab_start, vocab_start + rows). ``logits`` scores them (the LM head, or the embedding
    of a tied model)."""

    role = "embedding"  # which layers of a checkpoint's format this is (``WeightFormat.for_layer``)
    slots = ("weight",)
    bias = None

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__()
        self.tp = tp
        self.fmt = fmt.for_layer(self.role)
        self.vocab_start, self.rows = tp.vocab(vocab)
        self.fmt.check_shard("vocab rows", 0, self.vocab_start, self.rows, vocab)
        self.fmt.create(self, "weight", (self.rows, hidden), dtype, device)

    def shards(self, param: str) -> int:
        return 1

    def checkpoint_slice(self, param: str, part: str | None) -> Slice | None:
        return (0, *self.fmt.span(param, 0, self.vocab_start, self.rows)) if self.tp.size > 1 else None

    def load_weight(self, param: str, loaded: torch.Tensor, part: str | None, name: str) -> None:
        copy_checked(getattr(self, param).data, take(loaded, self.checkpoint_slice(param, part)), name)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [r, H] -> [r, rows] float32 logits of this rank's vocabulary rows: a plain weight
        multiplied with float32 accumulation and output, else the format's product, widened."""
        w = self.fmt.dense(self)
        return lm_head_fp32(h, w) if w is not None else self.fmt.apply(self, h).float()


class VocabEmbedding(VocabRows):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, fmt: WeightFormat = UNQUANTIZED) -> None:
        super().__init__(vocab, hidden, dtype, device, tp, fmt)
        if self.fmt.dense(self) is None:
            raise ValueError(f"the {self.fmt.name} weight format holds no plain embedding rows to look up "
                             f"(its for_layer('embedding') must give a format that does)")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        w = self.fmt.dense(self)  # [rows, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, w)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)  # [T] ids another rank holds
        x = F.embedding(local.masked_fill(outside, 0), w)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)


class LMHead(VocabRows):
    """The output projection. It has no forward: the scoring stage asks it for the float32
    logits of the scored rows only, in row chunks (``logits``, from ``engine.scoring``)."""

    role = "lm_head"
