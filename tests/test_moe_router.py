"""DeepSeek-V3's sigmoid router in one kernel (``ops.moe_router``) against the torch path
(``layers.deepseek_moe.deepseek_route`` on float32 logits): one group and group-limited picks,
with and without the score-correction bias and the renormalisation, expert counts that are not
powers of two (Kimi-K2's 384), fewer experts than the kernel's smallest tile; the check's
refusal of a wrong pick; the layer taking the kernel only where its check passed. Without a GPU
the kernel runs in Triton's interpreter where triton is installed; on the GPU at model shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from teacher_server.layers.deepseek_moe import deepseek_route

CASES = [(64, 6, 1, 1, True, True), (8, 2, 1, 1, True, False), (256, 8, 8, 4, True, True), (32, 4, 4, 2, False, True),
         (384, 8, 1, 1, True, True), (16, 2, 4, 2, True, True)]

_INTERPRETED = f"""
import json, torch
from teacher_server.ops import moe_router as m
from teacher_server.layers.deepseek_moe import deepseek_route
torch.manual_seed(0)
res = {{}}
for e, k, ng, tg, norm, bias in {CASES!r}:
    h = torch.randn(37, 96).half()
    w = torch.randn(e, 96) * 0.1
    b = torch.randn(e) * 0.05 if bias else None
    ref = lambda lg: deepseek_route(lg, b, k, "sigmoid", ng, tg, norm, 2.5)
    res[f"{{e}} {{k}} {{ng}} {{tg}} {{norm}} {{bias}}"] = m.check(h, w, b, k, ng, tg, norm, 2.5, ref)
# a reference that picks otherwise (the bias negated): the check refuses it
b = torch.randn(64) * 2
try:
    m.check(torch.randn(37, 96).half(), torch.randn(64, 96) * 0.1, b, 6, 1, 1, True, 2.5,
            lambda lg: deepseek_route(lg, -b, 6, "sigmoid", 1, 1, True, 2.5))
    res["wrong pick refused"] = False
except RuntimeError:
    res["wrong pick refused"] = True
# a row of NaN logits: ids still in range (the grouped GEMM and gather index with them)
h = torch.randn(5, 96).half()
h[2] = float("nan")
for e, ng, tg in ((72, 1, 1), (64, 8, 4)):
    _, ids = m.sigmoid_route(h, torch.randn(e, 96) * 0.1, None, 6, ng, tg, True, 1.0, any_size=True)
    res[f"NaN row in range {{e}}"] = bool(((ids >= 0) & (ids < e)).all())
print(json.dumps(res))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(v is True for v in res.values()), res


def test_layer_takes_the_kernel_only_where_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import teacher_server.layers.deepseek_moe as dm
    from teacher_server.layers.deepseek_moe import DeepseekMoe, ExpertRouting
    from teacher_server.layers.runtime import Runtime
    from teacher_server.ops.fused import FusedOps
    from teacher_server.ops.grouped_mm import GroupedGemm

    routing = ExpertRouting("sigmoid", "noaux_tc", 4, 2, 2.5, True)
    moe = DeepseekMoe(32, 16, 4, 24, True, 0, routing, GroupedGemm(), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    moe.bind(Runtime(None, FusedOps(kernels=False, compile=False), None, None))  # type: ignore[arg-type]
    h = torch.randn(9, 32)
    calls = []

    def stand_in(x, weight, bias, k, ng, tg, norm, scale):
        calls.append((k, ng, tg, norm, scale))
        return deepseek_route(x.float() @ weight.t(), bias, k, "sigmoid", ng, tg, norm, scale)

    monkeypatch.setattr(dm, "sigmoid_route", stand_in)
    want = moe.route(h)
    assert calls == []  # off: the torch path
    moe.rt.ops.router_kernel = True
    got = moe.route(h)
    assert calls == [(4, 4, 2, True, 2.5)]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    ops.check_router(moe, torch.device("cpu"), torch.float32)
    assert not ops.router_kernel  # CPU: never on


def test_ranks_agree_on_the_router_kernel() -> None:
    """Every rank must route alike: the kernel only where all ranks turned it on."""
    from teacher_server.models.moe import agreed

    class Ranks:  # two ranks: the other's flag is ``other``
        size = 2

        def __init__(self, other: float) -> None:
            self.other = other

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x.add_(self.other)

    cpu = torch.device("cpu")
    assert agreed(Ranks(1.0), True, cpu) and not agreed(Ranks(0.0), True, cpu) and not agreed(Ranks(1.0), False, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 2048, 6, 1, 1), (256, 7168, 8, 8, 4), (384, 7168, 8, 1, 1), (128, 4096, 8, 1, 1)])
def test_gpu_router_matches_the_torch_path(shape: tuple[int, int, int, int, int]) -> None:
    from teacher_server.ops import moe_router

    e, hdim, k, ng, tg = shape
    torch.manual_seed(0)
    w = torch.randn(e, hdim, device="cuda") * hdim ** -0.5
    b = torch.randn(e, device="cuda") * 0.01
    for t in (1, 300, 8192):
        h = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)
        ref = lambda lg: deepseek_route(lg, b, k, "sigmoid", ng, tg, True, 2.5)  # noqa: E731
        assert moe_router.check(h, w, b, k, ng, tg, True, 2.5, ref)
    print(shape, "faster than the torch path:", moe_router.faster(h, w, b, k, ng, tg, True, 2.5, ref))


def test_warm_up_decides_both_kernels_for_a_deepseek_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pick_gate_up`` (the expert families' warm-up) times the fused gate/up at the layer's own
    expert weights over all its experts, checks the router where the layer has DeepSeek's, and
    has the ranks agree on the router."""
    from teacher_server.layers.deepseek_moe import DeepseekMoe, ExpertRouting
    from teacher_server.models import moe as moe_models
    from teacher_server.ops.fused import FusedOps
    from teacher_server.ops.grouped_mm import GroupedGemm

    routing = ExpertRouting("sigmoid", "noaux_tc", 1, 1, 1.0, True)
    layer = DeepseekMoe(32, 8, 2, 24, True, 0, routing, GroupedGemm(), torch.float32, torch.device("cpu"))
    ops = FusedOps(kernels=False, compile=False)
    seen = []
    monkeypatch.setattr(ops, "pick_moe_gate_up", lambda w, k, gemm, total: seen.append(("gate_up", w, k, total)))
    monkeypatch.setattr(ops, "check_router", lambda lay, dev, dt: seen.append(("router", lay, dt)))
    monkeypatch.setattr(moe_models, "agreed", lambda tp, on, dev: seen.append(("agreed", tp.size, on)) or on)
    moe_models.pick_gate_up(ops, layer, torch.bfloat16)
    assert seen[0][0] == "gate_up" and seen[0][1] is layer.experts.gate_up and seen[0][2:] == (2, 8)
    assert seen[1] == ("router", layer, torch.bfloat16) and seen[2] == ("agreed", 1, False)
