"""The fused gate/up + SiLU-mul kernel (``ops.gate_up_silu``): on the CPU it never runs (the
MLP takes the GEMM and ``silu_mul``); tests marked ``gpu`` check it on Hopper against the
two-pass path and against float32 at the model shapes it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from teacher_server.ops import gate_up_silu as gus
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.silu_mul import silu_mul_reference


def test_not_run_on_cpu() -> None:
    h = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(256, 64, dtype=torch.bfloat16)
    assert gus.gate_up_silu(h, w) is None
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    assert ops.gate_up_act(h, w) is None
    ops.check_gate_up(64, 128, torch.device("cpu"), torch.bfloat16)
    assert not ops.gate_up_kernel  # does not apply here: off, so the MLP takes the two passes


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


def _rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("hidden,inter", [(64, 128), (256, 512), (4096, 12288), (5120, 25600)])
@pytest.mark.parametrize("tokens", [1, 77, 1000, 4099])
def test_matches_two_passes_and_float32(hidden: int, inter: int, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    got = gus.gate_up_silu(h, w)
    assert got is not None and got.shape == (tokens, inter) and got.dtype == torch.bfloat16
    two = silu_mul_reference(h @ w.t())
    gate, up = (h.float() @ w.float().t()).chunk(2, dim=-1)
    exact = F.silu(gate) * up  # the same bf16 inputs, float32 throughout
    # the two-pass path's rounding: error against float32 within a hair of it, and each
    # element within a couple of bf16 steps of it (the GEMMs may sum in another order)
    assert _rel_rms(got, exact) <= 1.02 * _rel_rms(two, exact) + 1e-6
    assert ((got.float() - two.float()).abs() <= 2 ** -6 * two.float().abs() + 1e-3).all()
    assert torch.equal(got, gus.gate_up_silu(h, w))  # the same bits every time


@pytest.mark.gpu
@hopper
def test_shapes_it_does_not_take() -> None:
    h = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    assert gus.gate_up_silu(h, torch.randn(192, 64, device="cuda", dtype=torch.bfloat16)) is None  # I = 96
    assert gus.gate_up_silu(h.float(), torch.randn(256, 64, device="cuda")) is None  # float32
    assert gus.gate_up_silu(h[:, :48], torch.randn(256, 48, device="cuda", dtype=torch.bfloat16)) is None  # strided
    assert gus.gate_up_silu(h[:0], torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)).shape == (0, 128)


@pytest.mark.gpu
@hopper
def test_start_up_check_turns_it_on() -> None:
    ops = FusedOps(kernels=True, compile=False)
    ops.check_gate_up(256, 512, torch.device("cuda"), torch.bfloat16)
    assert ops.gate_up_kernel
    ops.check_gate_up(64, 96, torch.device("cuda"), torch.bfloat16)  # a width it does not take
    assert not ops.gate_up_kernel


def test_start_up_check_catches_wrong_tiles_and_unstable_bits(monkeypatch) -> None:
    """The check's logic, with the kernel stood in for on the CPU: a correct one passes; a NaN
    tile, a slightly wrong one, or other bits on a second call each fail it."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    def right(h, w, *a, **kw):
        return silu_mul_reference(h @ w.t())

    def nan_tile(h, w, *a, **kw):
        out = right(h, w)
        out[-1:, :8] = float("nan")
        return out

    def off_by_a_tenth(h, w, *a, **kw):
        return right(h, w) * 1.1

    calls = []

    def unstable(h, w, *a, **kw):
        calls.append(1)
        out = right(h, w)
        if len(calls) % 2 == 0:
            out[0, 0] += 0.5  # the second call of each pair
        return out

    monkeypatch.setattr(gus, "gate_up_silu", right)
    assert gus.check_gate_up_silu(64, 128, cpu, bf16)
    for fake, says in ((nan_tile, "differs"), (off_by_a_tenth, "differs"), (unstable, "second call")):
        monkeypatch.setattr(gus, "gate_up_silu", fake)
        with pytest.raises(RuntimeError, match=says):
            gus.check_gate_up_silu(64, 128, cpu, bf16)
    monkeypatch.setattr(gus, "gate_up_silu", lambda *a, **kw: None)
    assert not gus.check_gate_up_silu(64, 128, cpu, bf16)  # does not apply


def test_the_gelu_check_compares_with_gemmas_activation(monkeypatch) -> None:
    """With act "gelu_tanh" the check holds the kernel to gelu_tanh(g) * u: a stand-in computing
    that passes, one computing SiLU fails; the activation reaches the kernel."""
    from teacher_server.ops.gelu_mul import gelu_tanh_mul

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    seen = []

    def gelu(h, w, *a, act="silu", **kw):
        seen.append(act)
        return gelu_tanh_mul(h @ w.t())

    monkeypatch.setattr(gus, "gate_up_silu", gelu)
    assert gus.check_gate_up_silu(64, 128, cpu, bf16, "gelu_tanh") and set(seen) == {"gelu_tanh"}
    monkeypatch.setattr(gus, "gate_up_silu", lambda h, w, *a, **kw: silu_mul_reference(h @ w.t()))
    with pytest.raises(RuntimeError, match="differs"):
        gus.check_gate_up_silu(64, 128, cpu, bf16, "gelu_tanh")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("hidden,inter", [(256, 512), (5376, 21504)])  # Gemma-3-27B's MLP
@pytest.mark.parametrize("tokens", [1, 77, 4099])
def test_gelu_epilogue_matches_two_passes_and_float32(hidden: int, inter: int, tokens: int) -> None:
    from teacher_server.ops.gelu_mul import gelu_tanh_mul

    g = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    got = gus.gate_up_silu(h, w, act="gelu_tanh")
    assert got is not None and got.shape == (tokens, inter)
    two = gelu_tanh_mul(h @ w.t())
    gate, up = (h.float() @ w.float().t()).chunk(2, dim=-1)
    exact = F.gelu(gate, approximate="tanh") * up
    assert _rel_rms(got, exact) <= 1.02 * _rel_rms(two, exact) + 1e-6
    assert ((got.float() - two.float()).abs() <= 2 ** -6 * two.float().abs() + 1e-3).all()
    ops = FusedOps(kernels=True, compile=False)
    ops.check_gate_up(hidden, inter, torch.device("cuda"), torch.bfloat16, "gelu_tanh")
    assert ops.gate_up_gelu_kernel and torch.equal(ops.gate_up_act(h, w, "gelu_tanh"), got)
