"""The softmax routers' selection in one Triton pass (``ops.softmax_topk``) against the torch
path (softmax, topk, renormalisation): Mixtral's, Qwen2-MoE's (60 experts, not renormalised),
Qwen3-MoE's, Qwen3.5-MoE's and Qwen3-Next's router sizes, exact ties, a NaN row, a wrong pick
refused, and the expert layer's output with the switch on. Without a GPU the kernel runs in
Triton's interpreter where triton is installed (a subprocess: the interpreter is chosen when
the kernel is defined); on the GPU, at model routers, and the warm-up's pick."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from teacher_server.ops import softmax_topk as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_INTERPRETED = """
import json, sys, torch
sys.path.insert(0, "tests")
from teacher_server.ops import softmax_topk as st
from test_moe import bound_moe
res = {}
g = torch.Generator().manual_seed(0)
for e, k, norm in ((8, 2, True), (60, 4, False), (64, 6, True), (128, 8, True), (256, 8, True), (512, 10, True)):
    logits = torch.randn(77, e, generator=g) * 3
    logits[5] = 0.5  # a row of exact ties: the lowest ids, as likely as the torch path's
    res[f"check {e} top-{k} norm={norm}"] = st.check(logits, k, norm)
    w, ids = st.softmax_topk(logits, k, norm)
    res[f"tie row {e}"] = sorted(ids[5].tolist()) == list(range(k))
nan = torch.randn(3, 64, generator=g)
nan[1] = float("nan")
w, ids = st.softmax_topk(nan, 6, True)
res["nan row in range"] = bool(((ids >= 0) & (ids < 64)).all())
bad = torch.randn(40, 64, generator=g)
real = st.softmax_topk_torch
st.softmax_topk_torch = lambda x, k, n: (lambda w, i: (w, (i + 1) % 64))(*real(x, k, n))  # a wrong reference
try:
    st.check(bad, 6, True)
    res["wrong pick refused"] = False
except RuntimeError:
    res["wrong pick refused"] = True
st.softmax_topk_torch = real
# DeepSeek's ungrouped sigmoid routing (Moonlight 64 top-6, GLM-4.5 128 top-8, Kimi-K2 384 top-8): the torch
# path is deepseek_route's with one group, and the kernel agrees with it, with and without bias and renormalisation
from teacher_server.layers.deepseek_moe import deepseek_route
for e, k, norm, has_bias in ((64, 6, True, True), (128, 8, True, True), (384, 8, True, True), (16, 2, False, False),
                             (72, 6, True, False)):
    logits = torch.randn(77, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.05 if has_bias else None
    ref = deepseek_route(logits, bias, k, "sigmoid", 1, 1, norm, 2.5)
    mine = st.sigmoid_topk_torch(logits, bias, k, norm, 2.5)
    res[f"sigmoid torch path is deepseek_route's {e}"] = bool(torch.equal(ref[1], mine[1]) and torch.equal(ref[0], mine[0]))
    res[f"sigmoid check {e} top-{k} norm={norm} bias={has_bias}"] = st.check(logits, k, norm, (bias, 2.5))
    w, ids = st.sigmoid_topk(logits, bias, k, norm, 2.5)
    if norm:
        res[f"sigmoid weights sum to the scale {e}"] = bool(torch.allclose(w.sum(-1), torch.full((77,), 2.5)))
bias = torch.randn(64, generator=g) * 2
try:  # a reference that picks by the bias negated: refused
    st.check(torch.randn(40, 64, generator=g), 6, True, (bias, 1.0)) and None
    real_s = st.sigmoid_topk_torch
    st.sigmoid_topk_torch = lambda x, b, k, n, c: real_s(x, -b, k, n, c)
    st.check(torch.randn(40, 64, generator=g), 6, True, (bias, 1.0))
    res["sigmoid wrong pick refused"] = False
except RuntimeError:
    res["sigmoid wrong pick refused"] = True
st.sigmoid_topk_torch = real_s
w, ids = st.sigmoid_topk(nan, bias, 6, True, 1.0)
res["sigmoid nan row in range"] = bool(((ids >= 0) & (ids < 64)).all())
res["sigmoid bias of another size refused"] = st.sigmoid_topk(nan, torch.zeros(8), 6, True, 1.0) is None
# an ungrouped DeepSeek layer (Moonlight's routing) routes through the kernel with the switch on, unchanged
from teacher_server.layers.deepseek_moe import DeepseekMoe, ExpertRouting
from teacher_server.layers.runtime import Runtime
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import GroupedGemm
ds = DeepseekMoe(32, 16, 4, 24, True, 24, ExpertRouting("sigmoid", "noaux_tc", 1, 1, 2.5, True), GroupedGemm(),
                 torch.float32, torch.device("cpu"))
with torch.no_grad():
    for p in ds.parameters():
        p.normal_(0, 0.3)
ds.bind(Runtime(None, FusedOps(kernels=False, compile=False), None, None))
h = torch.randn(77, 32)
plain = ds(h)
ds.rt.ops.router_kernel = True
calls = []
real_k = st.sigmoid_topk
import teacher_server.layers.deepseek_moe as dm
dm.sigmoid_topk = lambda *a: calls.append(a[1:]) or real_k(*a)
res["deepseek layer through the kernel"] = float((ds(h) - plain).abs().max()) <= 1e-5 and len(calls) == 1
dm.sigmoid_topk = real_k
moe = bound_moe(shared=40)
h = torch.randn(77, 32)
plain = moe(h)
moe.rt.ops.router_kernel = True
res["layer"] = float((moe(h) - plain).abs().max()) <= 1e-5
print(json.dumps(res))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res) == 33 and all(v is True for v in res.values()), res


def test_rows_per_program_shrink_with_the_experts() -> None:
    assert [st.rows_per_program(e) for e in (8, 128, 129, 256, 512)] == [64, 64, 32, 32, 16]


def test_the_layer_selects_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert layer hands its logits to the kernel only with the switch on; its stand-in
    (the torch path) gives the same output."""
    from test_moe import bound_moe

    import teacher_server.layers.moe as moe_mod

    moe = bound_moe(shared=0)
    h = torch.randn(29, 32)
    plain = moe(h)
    calls = []

    def stand_in(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((tuple(logits.shape), k, norm))
        return st.softmax_topk_torch(logits, k, norm)

    monkeypatch.setattr(moe_mod, "softmax_topk", stand_in)
    moe(h)
    assert calls == []
    moe.rt.ops.router_kernel = True
    assert torch.equal(moe(h), plain)
    assert calls == [((29, 16), 4, True)]


def test_the_warm_up_checks_a_softmax_router_and_has_the_ranks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_moe import bound_moe

    from teacher_server.models import moe as moe_models
    from teacher_server.ops.fused import FusedOps

    moe = bound_moe(shared=0)
    ops = FusedOps(kernels=False, compile=False)
    seen = []
    monkeypatch.setattr(ops, "pick_moe_gate_up", lambda *a: None)
    monkeypatch.setattr(ops, "check_router", lambda lay, dev, dt: seen.append(("router", lay, dt)))
    monkeypatch.setattr(moe_models, "agreed", lambda tp, on, dev: seen.append(("agreed", tp.size, on)) or on)
    moe_models.pick_gate_up(ops, moe, torch.bfloat16)
    assert seen == [("router", moe, torch.bfloat16), ("agreed", 1, False)]
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    ops.check_router(moe, torch.device("cpu"), torch.float32)
    assert not ops.router_kernel  # CPU: never on


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "experts", "top", "norm"),
                         [(4096, 8, 2, True), (2048, 60, 4, False), (2048, 128, 8, True), (2048, 256, 8, True),
                          (2048, 512, 10, True)])
def test_gpu_kernel_matches_the_torch_path_at_model_routers(hidden: int, experts: int, top: int, norm: bool) -> None:
    from teacher_server.layers.moe import ReplicatedLinear

    dev = torch.device("cuda")
    gate = ReplicatedLinear(hidden, experts, torch.bfloat16, dev)
    with torch.no_grad():
        gate.weight.normal_(0, hidden ** -0.5)
    h = torch.randn(4096, hidden, device=dev, dtype=torch.bfloat16)
    assert st.check(gate(h), top, norm)  # applies here, and agrees with the torch path
    faster = st.pick(gate, hidden, top, norm, dev, torch.bfloat16)
    print(f"{experts} experts, top-{top}: checked; faster than the torch path: {faster}")


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "experts", "top"), [(2048, 64, 6), (4096, 128, 8), (7168, 384, 8)])
def test_gpu_sigmoid_selection_matches_the_torch_path_at_model_routers(hidden: int, experts: int, top: int) -> None:
    """Moonlight's, GLM-4.5's and Kimi-K2's ungrouped sigmoid routing with a bias, from their
    float32 routers' logits; the warm-up's pick prints whether it is faster."""
    from teacher_server.layers.deepseek_moe import Float32Router

    dev = torch.device("cuda")
    gate = Float32Router(hidden, experts, True, dev)
    with torch.no_grad():
        gate.weight.normal_(0, hidden ** -0.5)
        gate.e_score_correction_bias.normal_(0, 0.02)
    h = torch.randn(4096, hidden, device=dev, dtype=torch.bfloat16)
    assert st.check(gate(h), top, True, (gate.e_score_correction_bias, 2.5))
    faster = st.pick(gate, hidden, top, True, dev, torch.bfloat16, sigmoid=(gate.e_score_correction_bias, 2.5))
    print(f"sigmoid {experts} experts, top-{top}: checked; faster than the torch path: {faster}")
