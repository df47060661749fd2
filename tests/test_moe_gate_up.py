"""The experts' fused gather + gate/up grouped GEMM + SiLU-mul (``ops.moe_gate_up``) against
the two passes it replaces (index_select, the grouped GEMM, SiLU-mul): odd widths (K and I
not multiples of the tiles), experts with no rows, an expert-parallel rank's rows past its
last row end (unwritten), and the layer taking it where the warm-up picked it. Without a GPU
the kernel runs in Triton's interpreter where triton is installed (a subprocess: the
interpreter is chosen when the kernel is defined); on the GPU, at model shapes, and the
warm-up's pick."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from teacher_server.ops import moe_gate_up
from teacher_server.ops.grouped_mm import grouped_mm_reference

_INTERPRETED = """
import json, torch
from teacher_server.ops import moe_gate_up as m
from teacher_server.ops.grouped_mm import grouped_mm_reference as ref
res = {}
for e, h, i, k in ((8, 64, 32, 2), (5, 96, 48, 3), (3, 160, 256, 1)):
    w = (torch.randn(e, 2 * i, h) * h ** -0.5).half()
    for c in m.CONFIGS:
        res[f"check {e}x{h}x{i} top-{k} {c}"] = m.check(w, k, ref, c)
# an expert-parallel rank: its 2 experts' rows first, the others' after its last row end
g = torch.Generator().manual_seed(0)
hs = torch.randn(20, 64, generator=g).half()
w = (torch.randn(2, 64, 64, generator=g) / 8).half()
tokens = torch.randint(0, 20, (31,), generator=g)
offs = torch.tensor([7, 19], dtype=torch.int32)
got = m.moe_gate_up_silu(hs, tokens, offs, w, out=torch.full((31, 32), float("nan"), dtype=torch.half))
want = m.two_pass(hs, tokens, offs, w, ref)
res["past the end"] = float((got[:19].float() - want[:19].float()).abs().max()) / float(want[:19].float().abs().max())
res["rows past the end unwritten"] = bool(got[19:].isnan().all())
# experts with no rows first and last, one expert, fewer rows than a block
for e, counts in ((4, [0, 5, 70, 0]), (1, [37]), (3, [0, 0, 0]), (6, [1, 0, 2, 0, 0, 3])):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    n = int(offs[-1])
    w = (torch.randn(e, 64, 64, generator=g) / 8).half()
    tokens = torch.randint(0, 20, (n,), generator=g)
    got = m.moe_gate_up_silu(hs, tokens, offs, w)
    want = m.two_pass(hs, tokens, offs, w, ref)
    res[f"counts {counts}"] = float((got.float() - want.float()).abs().max()) if n else 0.0
print(json.dumps(res))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    """float16: the interpreter's tl.dot multiplies bfloat16 tiles as their raw 16-bit integers
    (the kernel's logic is the same for both dtypes; the GPU tests take bfloat16)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(res[k] is True for k in res if k.startswith("check")), res  # each passed its comparison
    assert res["past the end"] <= 2 ** -6 and res["rows past the end unwritten"], res
    assert all(v <= 2 ** -5 for k, v in res.items() if k.startswith("counts")), res


def test_expert_blocks_number_each_experts_row_blocks() -> None:
    offs = torch.tensor([0, 5, 5, 70, 71], dtype=torch.int32)  # rows 0, 5, 0, 65, 1
    blk = moe_gate_up.expert_blocks(offs, 64)
    assert blk.tolist() == [0, 1, 1, 3, 4]
    # each block's expert; the grid's bound (cdiv(71, 64) + 5 = 7) past the last block: E
    assert moe_gate_up.block_experts(blk, 7).tolist() == [1, 3, 3, 4, 5, 5, 5]


def test_an_expert_parallel_ranks_routing_keeps_its_experts_rows() -> None:
    tokens, offs = moe_gate_up._routing(64, 8, 2, torch.device("cpu"), total=16)  # 2 of 16 experts, top-8
    assert offs.shape == (2,) and tokens.shape == (int(offs[-1]),) and 0 < int(offs[-1]) < 64 * 8
    tokens, offs = moe_gate_up._routing(5, 4, 1, torch.device("cpu"))  # top-4 of 1 expert: each token once
    assert offs.tolist() == [5] and sorted(tokens.tolist()) == [0, 1, 2, 3, 4]


def test_routing_of_the_checks_sorts_rows_by_expert_and_leaves_some_empty() -> None:
    tokens, offs = moe_gate_up._routing(50, 4, 16, torch.device("cpu"))
    assert tokens.shape == (200,) and offs[-1] == 200 and bool((offs[1:] >= offs[:-1]).all())
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert int(counts[1]) == 0 and int(counts[6]) == 0  # experts 1, 6, ... take no rows


def test_layer_takes_the_kernel_only_where_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert layer's output is the same through the kernel's path (here its two-pass
    definition stands in for it) and the layer calls it only with the switch on."""
    from test_moe import bound_moe

    import teacher_server.layers.moe as moe_mod

    moe = bound_moe(shared=0)
    h = torch.randn(29, 32)
    plain = moe(h)
    calls = []

    def stand_in(x, tokens, offs, w, config):
        assert config == moe_gate_up.CONFIG  # the default until a warm-up picks
        calls.append(tuple(w.shape))
        return moe_gate_up.two_pass(x, tokens, offs, w, grouped_mm_reference)

    monkeypatch.setattr(moe_mod, "moe_gate_up_silu", stand_in)
    moe(h)
    assert calls == []  # off: not called
    moe.rt.ops.moe_gate_up_kernel = True
    torch.testing.assert_close(moe(h), plain, rtol=1e-5, atol=1e-5)
    assert calls == [(16, 48, 32)]


def test_pick_stays_off_without_a_gpu() -> None:
    from teacher_server.ops.fused import FusedOps

    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    ops.pick_moe_gate_up(torch.randn(8, 64, 64, dtype=torch.bfloat16), 2, grouped_mm_reference, 8)
    assert not ops.moe_gate_up_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 2048, 1408, 6), (128, 2048, 768, 8), (256, 2048, 512, 8), (32, 2880, 2880, 4)])
def test_gpu_kernel_matches_the_two_passes_at_model_shapes(shape: tuple[int, int, int, int]) -> None:
    from teacher_server.ops.grouped_mm import GroupedGemm

    e, h, i, k = shape
    gemm = GroupedGemm()
    gemm.use_torch(torch.device("cuda"), torch.bfloat16, shapes=((h, 2 * i), (i, h)))
    w = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    assert moe_gate_up.check(w, k, gemm)
    # the warm-up's pick runs (its choice is the GPU's: printed, not asserted)
    from teacher_server.ops.fused import FusedOps

    for c in moe_gate_up.CONFIGS:
        assert moe_gate_up.check(w, k, gemm, c), c
    print(shape, "picked:", moe_gate_up.pick(w, k, gemm, act=FusedOps(kernels=True, compile=False).silu_mul))
