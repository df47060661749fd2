"""moe_combine: the expert layer's weighted sum, out[t] = sum_j w[t, j] * y[pos[t, j]] over a
token's k slots ([M, H] expert rows -> [T, H]), optionally with each row's expert bias added
to it first (gpt-oss's down bias). A slot at ``pad`` (an expert-parallel rank's slot of
another rank's expert) adds nothing.

The CUDA kernel (``csrc/elementwise.cu``) reads each slot's row once, in 16-byte vectors,
and keeps the weights and the sum in float32, rounded once; torch's ``embedding_bag`` (the
reference, and the path without the kernel) makes the same float32 sum of weights first
rounded to y's dtype, in a pass ~6x slower than the rows' bytes allow at Moonlight's shape
(a tenth of its step on the H100). A bias without the kernel is a pass of its own before
the sum, as the layer added it before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teacher_server.ops import extension
from teacher_server.ops.checks import assert_close
from teacher_server.ops.silu_mul import HALF, aligned


def moe_combine_reference(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, pad: int | None,
                          bias: torch.Tensor | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: ``embedding_bag``'s float32 sum of the slots' rows, weights in y's dtype."""
    if bias is not None:
        y = y + bias.index_select(0, experts)
    return F.embedding_bag(pos, y, mode="sum", per_sample_weights=w.to(y.dtype), padding_idx=pad)


def kernel_takes(y: torch.Tensor, pos: torch.Tensor, experts: torch.Tensor | None = None) -> bool:
    """CUDA bf16/fp16 rows [M, H], H a multiple of 8, rows 16-byte aligned, int64 slots (and
    experts) on y's device."""
    return (y.is_cuda and y.dtype in HALF and y.dim() == 2 and y.shape[1] % 8 == 0 and y.stride(1) == 1
            and y.stride(0) % 8 == 0 and aligned(y) and pos.dim() == 2 and pos.shape[1] > 0
            and pos.dtype == torch.int64 and pos.device == y.device
            and (experts is None or (experts.dtype == torch.int64 and experts.device == y.device)))


def moe_combine(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, pad: int | None, bias: torch.Tensor | None = None,
                experts: torch.Tensor | None = None, kernel: bool = True) -> torch.Tensor:
    """[T, H]: sum_j w[t, j] * (y[pos[t, j]] (+ bias[experts[pos[t, j]]])) over the slots not at
    ``pad`` (y [M, H], pos [T, k] int64, w [T, k] float32; bias [E, H] with experts [M]).
    The kernel where ``kernel`` and it takes the rows, else the reference."""
    assert (bias is None) == (experts is None), "moe_combine: a bias needs the rows' experts"
    plain = bias is None or (bias.dtype == y.dtype and bias.device == y.device and aligned(bias))
    if kernel and plain and kernel_takes(y, pos, experts):
        ext = extension.load()
        if ext is not None:
            out = y.new_empty(pos.shape[0], y.shape[1])
            ext.moe_combine_out(y, pos.contiguous(), w.float().contiguous(), -1 if pad is None else pad,
                                None if bias is None else bias.contiguous(),
                                None if bias is None else experts.contiguous(), out)
            return out
    return moe_combine_reference(y, pos, w, pad, bias, experts)


def check_moe_combine(hidden: int, top_k: int, device: torch.device, dtype: torch.dtype) -> None:
    """Start-up check: the kernel against the reference at the model's width and top-k (two
    token counts, a padded slot, with and without a bias). Raises RuntimeError on a mismatch."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for t in (16, 40):
        m = t * top_k + 1
        y = torch.randn(m, hidden, generator=g).to(device, dtype)
        pos = torch.randperm(t * top_k, generator=g).view(t, top_k).to(device)
        pos[3, top_k - 1] = m - 1  # the pad row: skipped
        w = torch.rand(t, top_k, generator=g).to(device)
        assert_close("moe_combine", moe_combine(y, pos, w, m - 1), moe_combine_reference(y, pos, w, m - 1))
        bias = torch.randn(5, hidden, generator=g).to(device, dtype)
        ex = torch.randint(0, 5, (m,), generator=g).to(device)
        assert_close("moe_combine with a bias", moe_combine(y, pos, w, None, bias, ex),
                     moe_combine_reference(y, pos, w, None, bias, ex))
