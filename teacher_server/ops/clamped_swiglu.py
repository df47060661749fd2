"""gpt-oss's expert activation, a stage of ``FusedOps`` (compiled: one pass that reads the
gate/up rows and their experts' bias rows and writes the activation; eager: a chain of
full-size passes). Its own torch reference: the compiled and eager forms are the same code.
With an expert-parallel row end (``ops.row_end``) a CUDA kernel (``kernels/elementwise.cu``)
computes only the rows before it, reading the end on the device; the compiled stage cannot
skip rows it has no count of."""

from __future__ import annotations

import torch

from teacher_server.ops import extension
from teacher_server.ops.checks import assert_close
from teacher_server.ops.silu_mul import aligned, kernel_takes


def clamped_swiglu(gate_up: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gate_up [M, 2I] (gate columns, then up), plus ``bias[rows]`` ([E, 2I] indexed by the
    [M] expert ids) -> [M, I] in gate_up's dtype: gate = min(gate, limit), up = clamp(up,
    -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), in float32."""
    n = gate_up.shape[1] // 2
    gu = gate_up.float() + bias.index_select(0, rows).float()
    gate = gu[:, :n].clamp(max=limit)
    up = gu[:, n:].clamp(-limit, limit)
    return ((up + 1.0) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)


def clamped_swiglu_kernel(gate_up: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor, alpha: float, limit: float,
                          end: torch.Tensor | None) -> torch.Tensor | None:
    """``clamped_swiglu`` by the CUDA kernel on the rows before ``end`` (int32 [1] on the
    device; the rows after it left unwritten), or all rows without it; None where the kernel
    does not take the input (not CUDA half, a width not a multiple of 8, unaligned, no library)."""
    if not (kernel_takes(gate_up) and bias.dtype == gate_up.dtype and bias.is_contiguous() and aligned(bias)):
        return None
    ext = extension.load()
    if ext is None:
        return None
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ext.clamped_swiglu_out(gate_up, bias, rows.long().contiguous(), alpha, limit, out, end)
    return out


def check_clamped_swiglu_kernel(bias: torch.Tensor, alpha: float, limit: float) -> None:
    """Start-up check of the kernel at the model's width (``bias`` [E, 2I], the experts'
    gate/up bias) with a row end: the rows before it as the torch definition's (those after it
    are never read). Raises RuntimeError on a mismatch."""
    m, end = 40, 29
    gu = 4 * torch.randn(m, bias.shape[1], device=bias.device, dtype=bias.dtype)  # past the clamp
    rows = torch.randint(0, bias.shape[0], (m,), device=bias.device)
    at = torch.tensor([end], dtype=torch.int32, device=bias.device)
    out = clamped_swiglu_kernel(gu, bias, rows, alpha, limit, at)
    if out is not None:
        assert_close("clamped_swiglu kernel", out[:end], clamped_swiglu(gu[:end], bias, rows[:end], alpha, limit))
