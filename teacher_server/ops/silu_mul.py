"""silu_mul: [T, 2I] -> [T, I], ``silu(gate) * up`` for the fused gate/up projection's
output, rounded as eager torch rounds. A CUDA kernel (``kernels/elementwise.cu``, ~2.5x
faster than the compiled torch version); the torch reference defines the semantics and runs
on the CPU, in float32, for odd shapes, or without the kernel. Given an expert-parallel row end
(``ops.row_end``), the rows after it are left unwritten: the kernel skips them on the device,
the CPU computes only those before it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teacher_server.ops import extension
from teacher_server.ops.checks import assert_close
from teacher_server.ops.row_end import before_end

HALF = (torch.bfloat16, torch.float16)


def aligned(t: torch.Tensor) -> bool:
    """16-byte aligned start: the kernels' vector loads need it."""
    return t.data_ptr() % 16 == 0


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_rows(gate_up: torch.Tensor, end: torch.Tensor | None = None) -> torch.Tensor:
    """The reference on the rows before ``end`` where the host reads it for free (the CPU),
    else on every row."""
    return before_end(silu_mul_reference, gate_up, end, gate_up.shape[-1] // 2)


def kernel_takes(gate_up: torch.Tensor) -> bool:
    """Whether the gate/up activation kernels (SiLU-mul, gpt-oss's clamped SwiGLU) take these
    rows: CUDA bf16/fp16 [T, 2I], I a multiple of 8, unit column stride, 16-byte aligned rows."""
    return (gate_up.is_cuda and gate_up.dtype in HALF and gate_up.dim() == 2 and gate_up.shape[1] % 16 == 0
            and gate_up.stride(1) == 1 and gate_up.stride(0) % 8 == 0 and aligned(gate_up))


def silu_mul(gate_up: torch.Tensor, end: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up (the kernel where it takes the input). ``end``
    (int32 [1] on gate_up's device): only rows before it are needed (``ops.row_end``)."""
    if kernel_takes(gate_up):
        ext = extension.load()
        if ext is not None:
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            ext.silu_mul_out(gate_up, out, end)
            return out
    return silu_mul_rows(gate_up, end)


def check_silu_mul(intermediate: int, device: torch.device, dtype: torch.dtype) -> None:
    """Start-up check: the op against its reference at the model's width (two token
    counts). Raises RuntimeError on a mismatch."""
    for n in (16, 40):
        gu = torch.randn(n, 2 * intermediate, device=device, dtype=dtype)
        assert_close("silu_mul", silu_mul(gu), silu_mul_reference(gu))
    # with a row end (expert parallel): the rows before it alike (those after it are never read)
    end = torch.tensor([29], dtype=torch.int32, device=device)
    assert_close("silu_mul before a row end", silu_mul(gu, end)[:29], silu_mul_reference(gu[:29]))
