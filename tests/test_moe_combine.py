"""The expert layer's weighted combine (``ops.moe_combine``): the reference against a plain
float32 loop on the CPU; on the GPU the CUDA kernel against the float32 sum (one rounding),
with padded slots, a per-expert bias, both half dtypes and the model widths."""

from __future__ import annotations

import pytest
import torch

from teacher_server.ops.fused import FusedOps
from teacher_server.ops.moe_combine import check_moe_combine, kernel_takes, moe_combine, moe_combine_reference


def _inputs(t: int, k: int, h: int, device: str, dtype: torch.dtype, pad: bool, experts: int = 0, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    m = t * k + (1 if pad else 0)
    y = torch.randn(m, h, generator=g).to(device, dtype)
    pos = torch.randperm(t * k, generator=g).view(t, k)
    if pad and t:
        pos[torch.rand(t, k, generator=g) < 0.2] = m - 1  # some slots at the row no slot reads
    w = torch.rand(t, k, generator=g)
    bias = ex = None
    if experts:
        bias = torch.randn(experts, h, generator=g).to(device, dtype)
        ex = torch.randint(0, experts, (m,), generator=g).to(device)
    return y, pos.to(device), w.to(device), (m - 1 if pad else None), bias, ex


def _exact(y, pos, w, pad, bias=None, ex=None) -> torch.Tensor:
    """The float32 sum by a loop over slots (the weights unrounded)."""
    rows = y.float() if bias is None else y.float() + bias.float()[ex]
    out = torch.zeros(pos.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(pos.shape[1]):
        p = pos[:, j]
        keep = (p != pad) if pad is not None else torch.ones_like(p, dtype=torch.bool)
        out += torch.where(keep[:, None], w[:, j, None] * rows[p.clamp_max(y.shape[0] - 1)], 0.0)
    return out


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("experts", [0, 4])
def test_reference_is_the_weighted_sum_of_the_slots(pad: bool, experts: int) -> None:
    y, pos, w, p, bias, ex = _inputs(11, 3, 24, "cpu", torch.float32, pad, experts)
    got = moe_combine(y, pos, w, p, bias, ex)  # the CPU: the reference
    torch.testing.assert_close(got, _exact(y, pos, w, p, bias, ex), rtol=1e-5, atol=1e-5)
    # a padded slot adds nothing: its row may hold anything
    if pad:
        y[-1] = float("nan")
        assert torch.isfinite(moe_combine(y, pos, w, p, bias, ex)).all()


def test_the_kernel_switch_follows_the_kernels() -> None:
    assert not FusedOps(kernels=False, compile=False).combine_kernel
    assert not FusedOps(kernels=True, compile=False, kernels_available=lambda: False).combine_kernel
    assert FusedOps(kernels=True, compile=False, kernels_available=lambda: True).combine_kernel
    y, pos, *_ = _inputs(2, 2, 16, "cpu", torch.bfloat16, False)
    assert not kernel_takes(y, pos)  # CPU rows: the reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,h,pad,experts", [(1, 1, 8, False, 0), (37, 6, 2048, True, 0), (300, 8, 7168, False, 0),
                                               (64, 4, 2880, True, 32), (0, 6, 2048, False, 0)])
def test_gpu_kernel_is_the_float32_sum_rounded_once(dtype, t, k, h, pad, experts) -> None:
    y, pos, w, p, bias, ex = _inputs(t, k, h, "cuda", dtype, pad, experts, seed=t)
    assert kernel_takes(y, pos)
    got = moe_combine(y, pos, w, p, bias, ex)
    exact = _exact(y, pos, w, p, bias, ex)
    assert got.dtype == dtype and got.shape == (t, h)
    # one rounding of the float32 sum: within half a step of the output format (plus summation order)
    step = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - exact).abs() <= 0.5 * step + 1e-6 * exact.abs().max()).all()
    # and no further from the exact sum than torch's embedding_bag (weights rounded to the dtype first)
    if t * k >= 200:
        ref = moe_combine_reference(y, pos, w, p, bias, ex)
        assert (got.float() - exact).abs().max() <= (ref.float() - exact).abs().max()
        assert torch.equal(moe_combine(y, pos, w, p, bias, ex, kernel=False), ref)


@pytest.mark.gpu
def test_gpu_kernel_reads_rows_by_stride_and_start_up_check_passes() -> None:
    y, pos, w, _, _, _ = _inputs(20, 6, 2048, "cuda", torch.bfloat16, False)
    wide = torch.zeros(y.shape[0], 2048 + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :2048] = y
    torch.testing.assert_close(moe_combine(wide[:, :2048], pos, w, None), moe_combine(y, pos, w, None), rtol=0, atol=0)
    check_moe_combine(2048, 6, torch.device("cuda"), torch.bfloat16)
    check_moe_combine(2880, 4, torch.device("cuda"), torch.float16)
