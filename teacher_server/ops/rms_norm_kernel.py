"""RMSNorm of a step's rows in one Triton pass: each program reads one row once, sums its
squares in float32 and writes ``x * rsqrt(mean(x^2) + eps) * w`` rounded once to x's dtype.

That is the rounding of the compiled stage (``ops.norm.rms_norm`` through ``torch.compile``,
which keeps the product in float32 up to the store) and, for a float32 weight, of Qwen3.5's
zero-centred norm in transformers; transformers' plain RMSNorm rounds ``x * rsqrt(...)``
before the weight, one bf16 step more (the start-up check allows it). A row's result does not
depend on the other rows of the step (one program a row, a fixed reduction), so deterministic
mode's batch invariance holds.

Why a kernel of our own: at a Qwen3-8B step of 16384 tokens the compiled stage took 0.139 ms
and torch's eager ``F.rms_norm`` 0.082 ms against 0.067 ms for this one (sustained, one H200;
``bench/bench_norm.py``), and the layer's MLP half ran 1.2% faster with it.
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernel's arguments take no annotations)
from __future__ import annotations

import logging
from typing import Any

import torch

from teacher_server.ops.checks import assert_close
from teacher_server.ops.norm import rms_norm

log = logging.getLogger(__name__)

MAX_WIDTH = 16384  # a row in one program's registers (up to 128 floats a thread at 4 warps)
WARPS = 4

_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """The kernel, compiled on first use ({"missing": True} without Triton)."""
    if _K:
        return _K
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # the CPU wheel has no Triton
        log.info("Triton RMSNorm unavailable: %s: %s", type(e).__name__, e)
        _K["missing"] = True
        return _K

    @triton.jit
    def rms(x_ptr, w_ptr, y_ptr, N, stride, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < N
        x = tl.load(x_ptr + row * stride + cols, mask=keep, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (x * r * w).to(y_ptr.dtype.element_ty), mask=keep)

    _K.update(rms=rms, block=triton.next_power_of_2)
    return _K


def eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Does the kernel take x ([..., n], half precision, rows of stride-1 elements, 2-D or
    contiguous) and w ([n], contiguous)?"""
    n = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and 0 < n <= MAX_WIDTH
            and w.dim() == 1 and w.shape[0] == n and w.is_contiguous() and w.device == x.device
            and w.dtype in (x.dtype, torch.float32) and x.stride(-1) == 1 and (x.dim() == 2 or x.is_contiguous())
            and "rms" in _kernels())


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x [..., n] with weight w [n] (a new contiguous tensor of x's shape), or None
    where the kernel does not take the input (the caller runs the torch stage)."""
    if not eligible(x, w):
        return None
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view: x is 2-D with unit column stride, or contiguous
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        k = _kernels()
        k["rms"][(rows.shape[0],)](rows, w, out, n, rows.stride(0), eps, BLOCK=k["block"](n), num_warps=WARPS)
    return out


def check_rms_norm(hidden: int, device: torch.device, dtype: torch.dtype, eps: float) -> bool:
    """Start-up check at the model's width: the kernel against the torch stage with a weight
    in the activation dtype and in float32 (Qwen3.5's), on 1, 40 and 4096 random rows (every
    output within a bf16 step of the reference's scale, NaN fails), and the same row's bits
    alone and in a batch. False where the kernel does not apply; RuntimeError on a mismatch."""
    for wdt in (dtype, torch.float32):
        w = (1 + 0.2 * torch.randn(hidden, device=device)).to(wdt)
        for n in (1, 40, 4096):
            x = 3 * torch.randn(n, hidden, device=device, dtype=dtype)
            got = rms_norm_rows(x, w, eps)
            if got is None:
                return False
            assert_close(f"rms_norm kernel ({n} rows, {wdt} weight)", got, rms_norm(x, w, eps))
            if not torch.equal(got[n // 2], rms_norm_rows(x[n // 2:n // 2 + 1], w, eps)[0]):
                raise RuntimeError(f"rms_norm kernel: a row's bits depend on the batch ({n} rows)")
    return True
