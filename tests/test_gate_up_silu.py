"""The fused gate/up + SiLU-mul kernel (``ops.gate_up_silu``): on the CPU it never runs (the
MLP takes the GEMM and ``silu_mul``); tests marked ``gpu`` check it on Hopper against the
two-pass path and against float32 at the model shapes it serves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from teacher_server.models.llama import LlamaMLP, layout_gate_up
from teacher_server.ops import gate_up_silu as gus
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.silu_mul import silu_mul_reference


def test_pair_rows_alternate_gate_and_up() -> None:
    assert gus.pair_rows(3).tolist() == [0, 3, 1, 4, 2, 5]


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
@pytest.mark.parametrize("paired", [False, True])
def test_matches_two_passes_and_float32(hidden: int, inter: int, tokens: int, paired: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    wk = w[gus.pair_rows(inter).cuda()].contiguous() if paired else w
    got = gus.gate_up_silu(h, wk, paired=paired)
    assert got is not None and got.shape == (tokens, inter) and got.dtype == torch.bfloat16
    two = silu_mul_reference(h @ w.t())
    gate, up = (h.float() @ w.float().t()).chunk(2, dim=-1)
    exact = F.silu(gate) * up  # the same bf16 inputs, float32 throughout
    # the two-pass path's rounding: error against float32 within a hair of it, and each
    # element within a couple of bf16 steps of it (the GEMMs may sum in another order)
    assert _rel_rms(got, exact) <= 1.02 * _rel_rms(two, exact) + 1e-6
    assert ((got.float() - two.float()).abs() <= 2 ** -6 * two.float().abs() + 1e-3).all()
    assert torch.equal(got, gus.gate_up_silu(h, wk, paired=paired))  # the same bits every time


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

    def right(h, w, *a, **k):
        return silu_mul_reference(h @ w.t())

    def nan_tile(h, w, *a, **k):
        out = right(h, w)
        out[-1:, :8] = float("nan")
        return out

    def off_by_a_tenth(h, w, *a, **k):
        return right(h, w) * 1.1

    calls = []

    def unstable(h, w, *a, **k):
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
    monkeypatch.setattr(gus, "gate_up_silu", lambda *a, **k: None)
    assert not gus.check_gate_up_silu(64, 128, cpu, bf16)  # does not apply


def _mlp(hidden: int = 32, inter: int = 48) -> LlamaMLP:
    mlp = LlamaMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter), torch.float32, torch.device("cpu"))
    mlp.gate_up_proj.weight.data.normal_()
    mlp.bind(SimpleNamespace(ops=FusedOps(kernels=False, compile=False, kernels_available=lambda: False)))
    return mlp


def test_mlp_in_the_paired_layout_gives_the_same_output() -> None:
    """The paired weight without the kernel (the CPU): the GEMM's columns alternate gate and up,
    and the MLP pairs them itself: the same values as part after part (float32 rounding apart);
    back again, the same weight; loading into reordered rows is refused."""
    mlp = _mlp()
    w0 = mlp.gate_up_proj.weight.detach().clone()
    h = torch.randn(5, 32)
    want = mlp(h)
    mlp.pair_rows(True)
    assert torch.equal(mlp.gate_up_proj.weight, w0[gus.pair_rows(48)])
    torch.testing.assert_close(mlp(h), want)  # the CPU GEMM may sum a column in another order
    mlp.pair_rows(True)  # already so: unchanged
    assert torch.equal(mlp.gate_up_proj.weight, w0[gus.pair_rows(48)])
    with pytest.raises(AssertionError, match="reordered"):
        mlp.gate_up_proj.load_weight("weight", torch.zeros(48, 32), "gate", "gate_proj.weight")
    mlp.pair_rows(False)
    assert torch.equal(mlp.gate_up_proj.weight, w0) and mlp.gate_up_proj.row_order is None
    torch.testing.assert_close(mlp(h), want)


def test_layout_follows_the_kernel_switches() -> None:
    layers = [SimpleNamespace(mlp=_mlp()), SimpleNamespace(mlp=torch.nn.Identity())]  # an expert layer: left alone
    ops = SimpleNamespace(gate_up_kernel=True, gate_up_paired=True)
    layout_gate_up(layers, ops)
    assert layers[0].mlp.gate_up_proj.row_order is not None
    for kernel, paired in ((False, True), (True, False)):
        ops.gate_up_kernel, ops.gate_up_paired = kernel, paired
        layout_gate_up(layers, ops)
        assert layers[0].mlp.gate_up_proj.row_order is None
