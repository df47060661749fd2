"""Float32 router logits from bf16 parts of the weight (``ops.split_gemm``): the parts sum to
the float32 weight, their logits agree with the float32 GEMM's, DeepSeek's router takes them
only where the warm-up picked them (on the GPU, for bf16 rows), and the ranks agree on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from teacher_server.ops import split_gemm


@pytest.mark.parametrize(("experts", "hidden"), [(64, 2048), (128, 4096), (256, 7168)])
def test_the_parts_sum_to_the_weight_and_give_its_logits(experts: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(experts)
    w = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    w[0, :4] = torch.tensor([1e-30, -1e38, 1.0 + 2 ** -23, -(2 ** -126)])  # tiny, huge, every bit, subnormal edge
    parts = split_gemm.split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3 * experts, hidden)
    back = parts[:experts].double() + parts[experts:2 * experts].double() + parts[2 * experts:].double()
    assert torch.equal(back.float(), w)  # 3 x 8 significant bits: float32's 24
    w[0, :4] = 0.01
    parts = split_gemm.split_bf16(w)
    h = torch.randn(300, hidden, generator=g).bfloat16()
    ref = F.linear(h.float(), w)
    got = split_gemm.split_logits(h, parts)
    assert got.dtype == torch.float32 and got.shape == (300, experts)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()  # summation order alone
    assert torch.equal(split_gemm.check(w, hidden, torch.device("cpu"), tokens=(1, 300, 2000)), parts)
    real = split_gemm.split_logits
    try:  # a GEMM whose float32 output lost precision (as a tf32 product would): refused
        split_gemm.split_logits = lambda x, p: real(x, p) * (1 + 2 ** -10)
        with pytest.raises(RuntimeError, match="split bf16 router GEMM"):
            split_gemm.check(w, hidden, torch.device("cpu"), tokens=(300,))
    finally:
        split_gemm.split_logits = real


def _layer(groups: int = 1):
    from teacher_server.layers.deepseek_moe import DeepseekMoe, ExpertRouting
    from teacher_server.layers.runtime import Runtime
    from teacher_server.ops.fused import FusedOps
    from teacher_server.ops.grouped_mm import GroupedGemm

    layer = DeepseekMoe(32, 16, 4, 24, True, 0, ExpertRouting("sigmoid", "noaux_tc", groups, 1, 2.5, True),
                        GroupedGemm(), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.bind(Runtime(None, FusedOps(kernels=False, compile=False), None, None))  # type: ignore[arg-type]
    return layer


def test_the_router_takes_the_parts_only_where_picked_and_for_bf16_gpu_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    h = torch.randn(9, 32)
    plain = layer(h)
    seen = []
    real = type(layer.gate).logits
    monkeypatch.setattr(type(layer.gate), "logits", lambda self, x, split: seen.append(split) or real(self, x, split))
    layer.rt.ops.router_gemm_split = True
    assert torch.equal(layer(h), plain) and seen == [True]  # float32 rows on the CPU: the float32 GEMM still
    assert layer.gate.parts is None
    assert torch.equal(layer.gate.logits(h.bfloat16(), True), layer.gate(h.bfloat16()))  # CPU: never the parts
    assert not layer.check_router_gemm(torch.device("cpu"), torch.bfloat16)
    layer.gate.parts = torch.zeros(1)
    layer.gate.load_weight("weight", torch.zeros(16, 32), None, "router")
    assert layer.gate.parts is None  # a new weight: its parts made again


def test_the_warm_up_decides_the_split_router_gemm_and_the_ranks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from teacher_server.models import moe as moe_models
    from teacher_server.ops.fused import FusedOps

    layer = _layer()
    ops = FusedOps(kernels=False, compile=False)
    seen = []
    monkeypatch.setattr(ops, "pick_moe_gate_up", lambda *a: None)
    monkeypatch.setattr(ops, "check_router", lambda *a: None)
    monkeypatch.setattr(ops, "check_router_gemm", lambda lay, dev, dt: seen.append(("split", lay, dt)))
    monkeypatch.setattr(moe_models, "agreed", lambda tp, on, dev: seen.append(("agreed", on)) or on)
    moe_models.pick_gate_up(ops, layer, torch.bfloat16)
    assert ("split", layer, torch.bfloat16) in seen and seen[-1] == ("agreed", False)
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    ops.check_router_gemm(layer, torch.device("cpu"), torch.bfloat16)
    assert not ops.router_gemm_split  # CPU: never on
    monkeypatch.setattr(type(layer), "check_router_gemm", lambda self, dev, dt: (_ for _ in ()).throw(
        RuntimeError("no mm.dtype")))
    ops.decide("router_gemm_split", "split router GEMM", lambda: layer.check_router_gemm(None, None),
                torch.device("cuda"))
    assert not ops.router_gemm_split  # a failing check leaves it off


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "hidden"), [(64, 2048), (128, 4096), (256, 7168), (384, 7168)])
def test_gpu_split_logits_match_the_float32_gemm(experts: int, hidden: int) -> None:
    """Moonlight's, GLM-4.5's, DeepSeek-V3's and Kimi-K2's routers on the GPU: the check passes
    (torch's GEMM with float32 output on bf16 inputs) and the timing against the float32 path
    is printed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (runs on the GPU machine)")
    w = torch.randn(experts, hidden, device="cuda") * hidden ** -0.5
    parts = split_gemm.check(w, hidden, torch.device("cuda"))
    print(f"{experts} experts, hidden {hidden}: checked; faster than the float32 GEMM: {split_gemm.faster(w, parts)}")
