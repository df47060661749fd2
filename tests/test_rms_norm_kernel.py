"""The decoder's RMSNorm kernel (``ops.rms_norm_kernel``): on the CPU it never runs (the
``rms_norm`` stage does); tests marked ``gpu`` check it on a GPU against float32 and against
the stage at the model widths it serves, a row's bits alone and in a batch, and the layouts it
takes and refuses."""

from __future__ import annotations

import pytest
import torch

from teacher_server.ops import rms_norm_kernel as rk
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.norm import rms_norm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_not_run_on_cpu() -> None:
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert rk.rms_norm_rows(x, w, 1e-6) is None
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    assert ops.norm_kernel
    torch.testing.assert_close(ops.norm(x, w, 1e-6), rms_norm(x, w, 1e-6))  # the stage answers
    ops.check_norm(64, torch.device("cpu"), torch.bfloat16, 1e-6)
    assert not ops.norm_kernel


def test_a_failing_check_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a):
        raise RuntimeError("rms_norm kernel differs from its torch reference")

    monkeypatch.setattr("teacher_server.ops.fused.check_rms_norm", broken)
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    ops.check_norm(64, torch.device("cuda"), torch.bfloat16, 1e-6)  # the check is stood in for: no GPU needed
    assert not ops.norm_kernel
    x, w = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(ops.norm(x, w, 1e-6), rms_norm(x, w, 1e-6))


def test_the_check_catches_a_wrong_or_batch_dependent_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's logic, with the kernel stood in for on the CPU (float32 activations)."""
    cpu = torch.device("cpu")

    def right(x, w, eps):
        return rms_norm(x.float(), w.float(), eps).to(x.dtype)

    def off_by_a_tenth(x, w, eps):
        return right(x, w, eps) * 1.1

    def batch_dependent(x, w, eps):
        return right(x, w, eps) + 0.02 * (x.shape[0] > 1)

    monkeypatch.setattr(rk, "rms_norm_rows", right)
    assert rk.check_rms_norm(64, cpu, torch.bfloat16, 1e-6)
    for fake, says in ((off_by_a_tenth, "differs"), (batch_dependent, "depend on the batch")):
        monkeypatch.setattr(rk, "rms_norm_rows", fake)
        with pytest.raises(RuntimeError, match=says):
            rk.check_rms_norm(64, cpu, torch.bfloat16, 1e-6)
    monkeypatch.setattr(rk, "rms_norm_rows", lambda *a: None)
    assert not rk.check_rms_norm(64, cpu, torch.bfloat16, 1e-6)  # does not apply


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("width", [64, 1000, 2048, 4096, 5120, 8192])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 77, 4099])
def test_matches_float32_and_the_stage(width: int, wdtype: torch.dtype, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(width + rows)
    x = (4 * torch.randn(rows, width, device="cuda", generator=g)).bfloat16()
    w = (1 + 0.3 * torch.randn(width, device="cuda", generator=g)).to(wdtype)
    got = rk.rms_norm_rows(x, w, 1e-6)
    assert got is not None and got.shape == x.shape and got.dtype == torch.bfloat16
    xf = x.float()
    exact = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    # one rounding of the float32 result: within half a bf16 step of it (plus float32 noise)
    assert ((got.float() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()
    stage = rms_norm(x, w, 1e-6)  # torch's own (transformers' rounding: within a bf16 step more)
    assert ((got.float() - stage.float()).abs() <= 2 ** -7 * exact.abs() + 1e-6).all()
    # a row's bits do not depend on the step's other rows
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(got[i], rk.rms_norm_rows(x[i:i + 1], w, 1e-6)[0])
    assert torch.equal(got, rk.rms_norm_rows(x, w, 1e-6))


@pytest.mark.gpu
@cuda
def test_layouts_it_takes_and_refuses() -> None:
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(10, 96, device="cuda", dtype=torch.bfloat16)
    x = wide[:, 16:80]  # rows with a stride of 96
    torch.testing.assert_close(rk.rms_norm_rows(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=0.02, rtol=0.01)
    x3 = torch.randn(3, 5, 64, device="cuda", dtype=torch.bfloat16)
    got = rk.rms_norm_rows(x3, w, 1e-5)
    assert got.shape == (3, 5, 64)
    torch.testing.assert_close(got, rms_norm(x3, w, 1e-5), atol=0.02, rtol=0.01)
    assert rk.rms_norm_rows(x3[:0], w, 1e-5).shape == (0, 5, 64)
    assert rk.rms_norm_rows(wide[:, :64].view(10, 1, 64).expand(10, 2, 64), w, 1e-5) is None  # not contiguous
    assert rk.rms_norm_rows(x.float(), w, 1e-5) is None  # float32 activations: the stage
    assert rk.rms_norm_rows(wide[:, ::2][:, :48], w[:48], 1e-5) is None  # elements not adjacent
    assert rk.rms_norm_rows(torch.randn(2, 2 * rk.MAX_WIDTH, device="cuda", dtype=torch.bfloat16),
                            torch.ones(2 * rk.MAX_WIDTH, device="cuda", dtype=torch.bfloat16), 1e-5) is None


@pytest.mark.gpu
@cuda
def test_start_up_check_turns_it_on() -> None:
    ops = FusedOps(kernels=True, compile=False)
    ops.check_norm(4096, torch.device("cuda"), torch.bfloat16, 1e-6)
    assert ops.norm_kernel
    x, w = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16), torch.ones(4096, device="cuda").bfloat16()
    assert torch.equal(ops.norm(x, w, 1e-6), rk.rms_norm_rows(x, w, 1e-6))
