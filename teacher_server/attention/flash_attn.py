"""The flash_attn backend: the ``flash-attn`` package's ``flash_attn_varlen_func`` (the
Docker image installs it)."""

from __future__ import annotations

import torch

from teacher_server.attention.packed import PackedBackend


class FlashAttnBackend(PackedBackend):
    name = "flash_attn"
    honours = frozenset({"window", "softcap", "sinks"})

    def __init__(self, concurrent_streams: int = 3) -> None:
        super().__init__(concurrent_streams)
        from flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
        ws = (-1, -1) if window is None else (window - 1, 0)
        return self._fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True, window_size=ws,
                        softcap=softcap or 0.0)

    def varlen_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, scale: float, window: int | None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ws = (-1, -1) if window is None else (window - 1, 0)
        out, lse, _ = self._fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True, window_size=ws,
                               softcap=softcap or 0.0, return_attn_probs=True)  # lse [Hq, T] float32
        return out, lse
