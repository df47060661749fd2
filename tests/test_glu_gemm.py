"""The CUTLASS gate/up + SiLU-mul kernel (``ops.glu_gemm``): the weight's row permutation on
the CPU; on Hopper (tests marked ``gpu``) the kernel against the two-pass path and float32 at
the model shapes it serves, for every config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from teacher_server.ops import glu_gemm as glu
from teacher_server.ops.silu_mul import silu_mul_reference


@pytest.mark.parametrize("inter,bn", [(128, 256), (384, 256), (64, 128), (12288, 256)])
def test_rows_are_a_permutation_pairing_gate_and_up(inter: int, bn: int) -> None:
    rows = glu.glu_rows(inter, bn)
    assert sorted(rows.tolist()) == list(range(2 * inter))
    c = torch.arange(2 * inter) % bn
    tile = torch.arange(2 * inter) // bn
    out = tile * (bn // 2) + (bn // 8) * ((c // 2) % 4) + c // 8  # the output column the epilogue writes
    gate = c % 2 == 0
    assert torch.equal(rows[gate], out[gate]) and torch.equal(rows[~gate], out[~gate] + inter)
    # neighbouring accumulator columns: the gate and up of one output
    assert torch.equal(rows[1::2] - rows[0::2], torch.full((inter,), inter))


def test_rows_refuse_a_width_the_tiles_do_not_divide() -> None:
    with pytest.raises(ValueError):
        glu.glu_rows(96, 256)


def test_not_run_on_cpu() -> None:
    h = torch.randn(8, 64, dtype=torch.bfloat16)
    assert glu.glu_gemm(h, torch.randn(256, 64, dtype=torch.bfloat16)) is None


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


def _rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("config", list(glu.CONFIGS))
@pytest.mark.parametrize("hidden,inter", [(256, 512), (4096, 12288), (5120, 25600)])
@pytest.mark.parametrize("tokens", [1, 77, 1000, 4099])
def test_matches_two_passes_and_float32(config: str, hidden: int, inter: int, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    bn = glu.tile_n(config)
    assert bn, glu.library.error
    w_glu = w[glu.glu_rows(inter, bn).cuda()].contiguous()
    got = glu.glu_gemm(h, w_glu, config)
    assert got is not None and got.shape == (tokens, inter) and got.dtype == torch.bfloat16
    two = silu_mul_reference(h @ w.t())
    gate, up = (h.float() @ w.float().t()).chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert _rel_rms(got, exact) <= 1.02 * _rel_rms(two, exact) + 1e-6
    assert ((got.float() - two.float()).abs() <= 2 ** -6 * two.float().abs() + 1e-3).all()
    assert torch.equal(got, glu.glu_gemm(h, w_glu, config))  # the same bits every time
    for swizzle, raster in ((2, 1), (4, 2)):  # the scheduler's order changes no output
        assert torch.equal(got, glu.glu_gemm(h, w_glu, config, swizzle=swizzle, raster=raster))


@pytest.mark.gpu
@hopper
def test_shapes_it_does_not_take() -> None:
    h = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    assert glu.glu_gemm(h, torch.randn(384, 64, device="cuda", dtype=torch.bfloat16)) is None  # 2I not tiled
    assert glu.glu_gemm(h.half(), torch.randn(512, 64, device="cuda", dtype=torch.half)) is None  # fp16
    assert glu.glu_gemm(h[:, :48], torch.randn(512, 48, device="cuda", dtype=torch.bfloat16)) is None  # strided
    assert glu.glu_gemm(h[:0], torch.randn(512, 64, device="cuda", dtype=torch.bfloat16)).shape == (0, 256)
