"""Attention backends behind one interface (``base``), one file per backend, made by name
through ``registry.make_backend``:

- ``sdpa``: per-sequence ``scaled_dot_product_attention`` (CPU, float32, the reference).
- ``varlen``: torch's FlashAttention-2 varlen (``torch.nn.attention.varlen.varlen_attn``).
- ``flash_attn``: the ``flash-attn`` package's ``flash_attn_varlen_func``.
- ``cudnn``: cuDNN attention per sequence of at least 256 queries, at bucketed lengths
  (``buckets``), torch varlen for the short rest; checked at start-up (``cudnn_check``).
- ``cudnn_fe``: cuDNN through its Python frontend (``nvidia-cudnn-frontend``), a step's fresh
  sequences in one call and its prefixed ones in another on the packed layout; the GPU
  default where installed (a lone prefixed sequence with built plans takes ``cudnn``'s split).

``packed`` holds the planning the CUDA backends share.
"""

from teacher_server.attention.base import AttentionBackend, AttentionInputs
from teacher_server.attention.registry import make_backend

__all__ = ["AttentionBackend", "AttentionInputs", "make_backend"]
