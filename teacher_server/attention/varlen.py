"""The varlen backend: torch's FlashAttention-2 varlen
(``torch.nn.attention.varlen.varlen_attn``), GQA included."""

from __future__ import annotations

import inspect

import torch

from teacher_server.attention.packed import PackedBackend


class TorchVarlenBackend(PackedBackend):
    name = "varlen"
    sinks_by_lse = True  # attention sinks through the returned log-sum-exp (where this torch returns it)

    def __init__(self, concurrent_streams: int = 3) -> None:
        super().__init__(concurrent_streams)
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        self._has_gqa_flag = "enable_gqa" in params
        if "return_aux" in params and self.sinks_by_lse:  # the log-sum-exp out: attention sinks are taken
            self.honours = type(self).honours | {"sinks"}

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
        return self._fn(q, k, v, cu_q, cu_k, max_q, max_k, **self._kw(q, k, scale, window, softcap))

    def varlen_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, scale: float, window: int | None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.nn.attention.varlen import AuxRequest

        out, lse = self._fn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
                            **self._kw(q, k, scale, window, softcap))
        return out, lse

    def _kw(self, q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None,
            softcap: float | None) -> dict:
        assert softcap is None, "torch varlen takes no soft-cap (refused at start-up: ``refusal``)"
        kw = {"scale": scale, "window_size": (-1 if window is None else window - 1, 0)}
        if self._has_gqa_flag and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        return kw
