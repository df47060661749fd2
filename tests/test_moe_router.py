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


def test_a_tie_at_the_group_cut_excuses_other_picks_and_nothing_else() -> None:
    """Group-limited routing (DeepSeek-V3: 8 groups, 4 kept): where the last kept group and the
    first dropped one score alike, float32 noise may keep either, and the experts then picked
    differ by far more than a score tie; the check allows those rows (``group_cut_tied``) and no
    other row: the same different picks at a clear cut are refused."""
    from teacher_server.ops.checks import assert_same_picks
    from teacher_server.ops.moe_router import group_cut_tied

    torch.manual_seed(3)
    e, ng, tg, k = 32, 8, 4, 4
    choice = torch.rand(2, e) * 0.1
    for row, second in ((0, 0.5), (1, 0.5 - 1e-3)):  # groups 0 and 5 tie (row 0) or not (row 1) for 4th place
        choice[row, :12] = torch.tensor([0.9, 0.9, 0, 0, 0.8, 0.8, 0, 0, 0.7, 0.7, 0, 0])  # groups 0-2 kept
        choice[row, 12:16] = torch.tensor([0.3, 0.2, 0, 0])  # group 3 (0.5)
        choice[row, 20:24] = torch.tensor([0.4, second - 0.4, 0, 0])  # group 5 (0.5 or just under)
    tied = group_cut_tied(choice, ng, tg, 1e-5)
    assert tied.tolist() == [True, False]
    assert group_cut_tied(choice, 1, 1, 1e-5) is None and group_cut_tied(choice, 8, 8, 1e-5) is None

    def route(keep_group: int) -> tuple[torch.Tensor, torch.Tensor]:  # the 4 best of groups 0-2 and keep_group
        mask = torch.zeros(2, e, dtype=torch.bool)
        for g in (0, 1, 2, keep_group):
            mask[:, 4 * g:4 * g + 4] = True
        ids = choice.masked_fill(~mask, -1).topk(k, dim=-1).indices
        ids[:, 3] = 4 * keep_group  # (the kept extra group's best expert in the last place)
        return choice.gather(1, ids), ids

    got, ref = route(5), route(3)
    with pytest.raises(RuntimeError, match="biased scores"):
        assert_same_picks("router kernel", got, ref, choice, 1e-5, "biased scores")  # no excuse: refused
    with pytest.raises(RuntimeError, match="biased scores"):  # row 1's cut is clear: still refused
        assert_same_picks("router kernel", got, ref, choice, 1e-5, "biased scores", tied)
    one = tuple(x[:1] for x in got), tuple(x[:1] for x in ref)
    assert_same_picks("router kernel", *one, choice[:1], 1e-5, "biased scores", tied[:1])  # row 0 alone: allowed


def test_an_ungrouped_sigmoid_router_picks_the_selection_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """One group (Moonlight, GLM-4.5, Kimi-K2): the warm-up asks ``softmax_topk.pick`` about the
    selection from cuBLAS's logits, with the layer's bias and scale, and never the fused GEMM
    kernel; group-limited routing (V3) asks the fused kernel's check only."""
    import teacher_server.layers.deepseek_moe as dm
    from teacher_server.layers.deepseek_moe import DeepseekMoe, ExpertRouting
    from teacher_server.ops.grouped_mm import GroupedGemm

    asked = []
    monkeypatch.setattr(dm.softmax_topk, "pick", lambda *a, **k: asked.append(("select", a[2:4], k)) or True)
    monkeypatch.setattr(dm.moe_router, "check", lambda *a: asked.append(("fused",)) or False)
    one = DeepseekMoe(32, 16, 4, 24, True, 0, ExpertRouting("sigmoid", "noaux_tc", 1, 1, 2.5, True), GroupedGemm(),
                      torch.float32, torch.device("cpu"))
    assert one.check_router_kernel(torch.device("cpu"), torch.float32)
    (kind, (k, norm), kw), = asked
    assert kind == "select" and (k, norm) == (4, True)
    assert kw["sigmoid"][0] is one.gate.e_score_correction_bias and kw["sigmoid"][1] == 2.5
    asked.clear()
    v3 = DeepseekMoe(32, 16, 4, 24, True, 0, ExpertRouting("sigmoid", "noaux_tc", 4, 2, 2.5, True), GroupedGemm(),
                     torch.float32, torch.device("cpu"))
    assert not v3.check_router_kernel(torch.device("cpu"), torch.float32) and asked == [("fused",)]
