"""Float32 router logits from bf16 tensor-core products (DeepSeek-V3, Moonlight, GLM-4.5,
Kimi-K2 route on float32 logits of float32 weights, as transformers does).

The torch path is ``F.linear(h.float(), w)``: a copy of the layer's input to float32 (at
Moonlight's hidden size and 16,384 tokens, 112 us) and a float32 GEMM on the CUDA cores (108
us), 1.5% and 1.45% of Moonlight-16B-A3B's step on the H100 (`c98892b`'s profile). Here the
float32 weight is held as three bf16 parts, w = hi + mid + lo (each the rounding of what the
parts before it left: 3 x 8 significant bits, float32's 24), and the bf16 input, exact in
bf16, multiplies all three in one GEMM of 3E columns with float32 output: every product of
two bf16 values is exact in float32, the sums are float32, and the logit is the sum of its
three partial sums, the smallest first. The result differs from the float32 GEMM's by
summation order, as two float32 GEMMs' may (``check``: within 1e-5 of the logits' scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teacher_server.ops.checks import assert_close
from teacher_server.ops.checks import faster as timed_faster


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """[E, H] float32 -> [3E, H] bf16: the parts hi, mid, lo stacked, w == hi + mid + lo to
    float32's precision."""
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo]).contiguous()


def split_logits(h: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """[T, H] bf16 rows times the weight ``split_bf16`` made ``parts`` of: [T, E] float32 (one
    GEMM with float32 output on CUDA; the same products in float32 elsewhere)."""
    e = parts.shape[0] // 3
    if h.is_cuda:
        y = torch.mm(h, parts.t(), out_dtype=torch.float32)
    else:
        y = h.float() @ parts.float().t()
    return (y[:, 2 * e:] + y[:, e:2 * e]) + y[:, :e]


def check(weight: torch.Tensor, hidden: int, device: torch.device,
          tokens: tuple[int, ...] = (1, 300, 16384)) -> torch.Tensor:
    """The parts of ``weight`` where their logits agree with ``F.linear(h.float(), weight)`` on
    random bf16 rows (``tokens`` of them each time) within 1e-5 of the logits' largest magnitude
    (RuntimeError otherwise; an exception where the GEMM with float32 output is missing)."""
    parts = split_bf16(weight)
    g = torch.Generator().manual_seed(5)
    for t in tokens:
        h = torch.randn(t, hidden, generator=g).to(device, torch.bfloat16)
        assert_close("split bf16 router GEMM", split_logits(h, parts), F.linear(h.float(), weight), rel=1e-5,
                     floor=1e-6)
    return parts


def faster(weight: torch.Tensor, parts: torch.Tensor, margin: float = 0.03) -> bool:
    """Whether the parts' GEMM beats the float32 path at 16,384 tokens by ``margin`` (logs both)."""
    h = torch.randn(16384, weight.shape[1], device=weight.device, dtype=torch.bfloat16)
    return timed_faster("split bf16 router GEMM", lambda: split_logits(h, parts), lambda: F.linear(h.float(), weight),
                        "the float32 GEMM", f"{weight.shape[0]} experts, hidden {weight.shape[1]}", margin)
