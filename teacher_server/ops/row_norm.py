"""RMSNorm passes in Triton: the normed rows (one read, one write), or only each row's
1 / rms (one read, [T] float32 written) for a consumer that scales its own products by it.

# ruff: noqa
"""

# ruff: noqa: ANN001, ANN202  (the Triton kernels' arguments take no annotations)
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_K: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    if _K:
        return _K
    try:
        import triton
        import triton.language as tl
    except Exception as e:
        log.info("Triton RMSNorm unavailable: %s: %s", type(e).__name__, e)
        _K["missing"] = True
        return _K

    @triton.jit(do_not_specialize=["M"])
    def rms(x_ptr, w_ptr, y_ptr, r_ptr, M, N, stride, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
            WRITE_Y: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        if WRITE_Y:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            h = (x * r[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
            y = (h * w[None, :]).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y, mask=mask)
        else:
            tl.store(r_ptr + rows, r, mask=rows < M)

    _K.update(rms=rms, next_power_of_2=triton.next_power_of_2)
    return _K


def _launch(x: torch.Tensor, w: torch.Tensor | None, eps: float, rows: int, warps: int) -> torch.Tensor:
    k = _kernels()
    m, n = x.shape
    block = k["next_power_of_2"](n)
    if w is not None:
        out = torch.empty_like(x)
        r = out
    else:
        out = torch.empty(m, dtype=torch.float32, device=x.device)
        r = out
    if m:
        k["rms"][(-(-m // rows),)](x, w if w is not None else x, out, r, m, n, x.stride(0), eps, BLOCK=block,
                                   ROWS=rows, WRITE_Y=w is not None, num_warps=warps)
    return out


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float, rows: int = 1, warps: int = 4) -> torch.Tensor:
    """RMSNorm of x [T, n] (rows contiguous) with weight w [n], rounded as transformers rounds."""
    return _launch(x, w, eps, rows, warps)


def inv_rms(x: torch.Tensor, eps: float, rows: int = 1, warps: int = 4) -> torch.Tensor:
    """1 / rms of each row of x [T, n]: [T] float32."""
    return _launch(x, None, eps, rows, warps)
