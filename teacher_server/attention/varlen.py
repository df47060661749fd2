"""The varlen backend: torch's FlashAttention-2 varlen
(``torch.nn.attention.varlen.varlen_attn``), GQA included."""

from __future__ import annotations

import inspect

import torch

from teacher_server.attention.packed import PackedBackend


class TorchVarlenBackend(PackedBackend):
    name = "varlen"

    def __init__(self, concurrent_streams: int = 3) -> None:
        super().__init__(concurrent_streams)
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        self._has_gqa_flag = "enable_gqa" in inspect.signature(varlen_attn).parameters

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "torch varlen takes no soft-cap (refused at start-up: ``refusal``)"
        kw = {"scale": scale, "window_size": (-1 if window is None else window - 1, 0)}
        if self._has_gqa_flag and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        return self._fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
