"""Every Triton kernel of ours, compiled for the GPU the service runs on (Hopper, sm_90) at the
shapes of the models that call it, on this machine with no GPU (``tests/triton_sm90.py``): each
launch the op makes compiles, fits Hopper's shared memory and spills no registers, and the
matrix kernels' loads are pipelined into wgmma. A kernel that fails one of these would fail or
crawl on the device, where a run costs a lease; here it costs a test."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton_sm90
from triton_sm90 import SHARED_LIMIT, Launch, compiled_launches

from teacher_server.ops import (
    conv_prep,
    fp8_grouped,
    fp8_moe,
    fp8_quant,
    gate_up_silu,
    gated_delta,
    gated_qk,
    moe_gate_up,
    moe_group,
    moe_router,
    softmax_topk,
)
from teacher_server.ops import top_k as top_k_ops

pytestmark = pytest.mark.skipif(triton_sm90.available() is not None, reason=str(triton_sm90.available()))

BF = torch.bfloat16
HOPPER_SMS = 132


def assert_sound(launches: list[Launch], count: int, matrix: bool) -> None:
    assert len(launches) == count, [(k.name, k.options) for k in launches]
    for k in launches:
        where = f"{k.name} {k.options}: {k.registers} registers, {k.stack} B stack, {k.shared} B shared"
        assert k.shared <= SHARED_LIMIT, where
        assert k.stack == 0, f"spills registers: {where}"
        if matrix:
            assert k.pipelined and k.wgmma, f"loads not pipelined into wgmma: {where}"


# (hidden, experts, intermediate) of the models whose expert layers take the fused gate/up
EXPERT_SHAPES = {"moonlight": (2048, 64, 1408), "deepseek-v3": (7168, 256, 2048), "qwen3.5-35b-a3b": (2048, 256, 512),
                 "qwen3-30b-a3b": (2048, 128, 768), "glm-4.5-air": (4096, 128, 1408)}


@pytest.mark.parametrize("model", sorted(EXPERT_SHAPES))
def test_the_fused_expert_gate_up_kernel_at_each_expert_model(model: str) -> None:
    hidden, experts, inter = EXPERT_SHAPES[model]
    experts = min(experts, 16)  # the weights are never read: a 16-expert stack has the strides of the real one
    t, top = 1024, 8
    h = torch.empty(t, hidden, dtype=BF)
    w = torch.empty(experts, 2 * inter, hidden, dtype=BF)
    tokens = torch.zeros(t * top, dtype=torch.int64)
    offs = torch.full((experts,), t * top, dtype=torch.int32)
    with compiled_launches() as launches:
        for config in moe_gate_up.CONFIGS:
            moe_gate_up.moe_gate_up_silu(h, tokens, offs, w, config)
    assert_sound(launches, len(moe_gate_up.CONFIGS), matrix=True)


# (hidden, experts, groups, groups kept, top-k) of the sigmoid routers
ROUTERS = {"deepseek-v3": (7168, 256, 8, 4, 8), "kimi-k2": (7168, 384, 1, 1, 8), "moonlight": (2048, 64, 1, 1, 6),
           "glm-4.5-air": (4096, 128, 1, 1, 8)}


@pytest.mark.parametrize("model", sorted(ROUTERS))
def test_the_router_kernel_at_each_router(model: str) -> None:
    hidden, experts, groups, keep, top = ROUTERS[model]
    h = torch.empty(4096, hidden, dtype=BF)
    with compiled_launches() as launches:
        moe_router.sigmoid_route(h, torch.empty(experts, hidden), torch.empty(experts), top, groups, keep, True, 2.5,
                                 any_size=True)
    assert_sound(launches, 1, matrix=False)  # float32 products on the FMA units (module docstring)


# (hidden, intermediate): Qwen3-8B, Qwen3-32B, Moonlight's two shared experts as one MLP, Gemma-3-27B
DENSE_MLPS = [(4096, 12288), (5120, 25600), (2048, 2816), (5376, 21504)]


@pytest.mark.parametrize(("hidden", "inter"), DENSE_MLPS)
def test_the_dense_gate_up_kernel_in_every_config(monkeypatch: pytest.MonkeyPatch, hidden: int, inter: int) -> None:
    monkeypatch.setattr(gate_up_silu, "_gpu", lambda device: (True, HOPPER_SMS))
    h, w = torch.empty(2048, hidden, dtype=BF), torch.empty(2 * inter, hidden, dtype=BF)
    with compiled_launches() as launches:
        for config, (_, bn, *_rest) in gate_up_silu.CONFIGS.items():
            gate_up_silu._launch("fused", h, w, inter, bn, config, FLATTEN=False, WS=True, EXACT=False, GELU=False)
        for exact, gelu in ((True, False), (False, True)):  # the exact SiLU epilogue, Gemma's gelu_tanh
            gate_up_silu._launch("fused", h, w, inter, 128, gate_up_silu.DEFAULT, FLATTEN=False, WS=True,
                                 EXACT=exact, GELU=gelu)
    assert_sound(launches, len(gate_up_silu.CONFIGS) + 2, matrix=True)


@pytest.mark.parametrize("stored_states", [False, True])
def test_the_linear_layers_input_stage_at_qwen35s_heads(stored_states: bool) -> None:
    nk, dk, nv, dv, width = 16, 128, 32, 128, 4  # Qwen3.5-9B and 35B-A3B
    d = 2 * nk * dk + nv * dv
    proj = torch.empty(4096, d + nv * dv + 2 * nv, dtype=BF)  # the in-projection's output: q | k | v, z, b, a
    b, a = proj[:, d + nv * dv:d + nv * dv + nv], proj[:, d + nv * dv + nv:]
    plan = gated_delta.make_plan([3000, 1096], torch.tensor([0, 3000, 4096], dtype=torch.int32), stored_states, True)
    initial = torch.empty(2, d, width, dtype=BF) if stored_states else None
    with compiled_launches() as launches:
        conv_prep.conv_prep(proj[:, :d], torch.empty(d, width, dtype=BF), plan, initial, True, b, a,
                            torch.empty(nv, dtype=BF), torch.empty(nv, dtype=BF), nk, dk, nv, dv)
    # q, k and v heads over all tokens (and again over the first tokens with stored states), the end states
    assert_sound(launches, 3 * (2 if stored_states else 1) + 1, matrix=False)


@pytest.mark.parametrize(("n_q", "n_kv"), [(16, 4), (8, 2), (16, 2)])  # Qwen3.5-9B, its TP2 shard, the 35B-A3B
def test_the_gated_attention_input_kernel_at_qwen35s_heads(n_q: int, n_kv: int) -> None:
    d, t = 256, 4096
    qkv = torch.empty(t, (2 * n_q + 2 * n_kv) * d, dtype=BF)
    bufs = gated_qk._buffers(qkv, t, gated_qk.HeadLayout(n_q, n_kv, d, 1e-6))
    with compiled_launches() as launches:
        gated_qk.gated_qk(qkv, torch.empty(t, 64), torch.empty(d), torch.empty(d), n_q, n_kv, d, 1e-6, *bufs)
    assert_sound(launches, 1, matrix=False)


@pytest.mark.parametrize(("hidden", "inter"), [(4096, 12288), (5120, 25600)])
def test_the_fp8_quantization_kernels_at_dense_widths(monkeypatch: pytest.MonkeyPatch, hidden: int,
                                                      inter: int) -> None:
    monkeypatch.setattr(fp8_quant, "applies", lambda x, k: True)  # CUDA only
    x = torch.empty(1024, hidden, dtype=BF)
    with compiled_launches() as launches:
        for mode in ("row", "group"):
            assert fp8_quant.quantize(x, mode, "norm", fp8_max=448.0, amax_floor=1e-12, weight=torch.empty(hidden, dtype=BF),
                                      eps=1e-6, delta=torch.empty_like(x)) is not None
            assert fp8_quant.quantize(torch.empty(1024, 2 * inter, dtype=BF), mode, "silu", fp8_max=448.0,
                                      amax_floor=1e-12) is not None
        # power-of-two group scales (the experts' down input with per-channel weights)
        assert fp8_quant.quantize(torch.empty(1024, 2 * inter, dtype=BF), "group_pow2", "silu", fp8_max=448.0,
                                  amax_floor=1e-12) is not None
    assert_sound(launches, 5, matrix=False)


@pytest.mark.parametrize(("experts", "n", "k"), [(128, 1536, 2048), (128, 2048, 768)])  # Qwen3-30B-A3B's gate/up, down
def test_the_fp8_grouped_gemm_at_an_expert_layers_shapes(monkeypatch: pytest.MonkeyPatch, experts: int, n: int,
                                                         k: int) -> None:
    monkeypatch.setattr(fp8_grouped, "applies", lambda x, w: True)  # CUDA only
    experts = min(experts, 16)
    x = torch.empty(1024, k, dtype=torch.float8_e4m3fn)
    w = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn)
    offs = torch.full((experts,), 1024, dtype=torch.int32)
    with compiled_launches() as launches:
        for bm in (64, 128):
            fp8_grouped.grouped_block_mm(x, torch.empty(1024, k // 128), w, torch.empty(experts, n // 128, k // 128),
                                         offs, bm=bm)
        fp8_grouped.grouped_block_mm(x, torch.empty(1024), w, torch.empty(experts, n), offs, row=True)
        # the down product after ops.fp8_moe: 1x128 input groups with per-channel weights
        fp8_grouped.grouped_block_mm(x, torch.empty(1024, k // 128), w, torch.empty(experts, n), offs, x_groups=True,
                                     w_blocks=False)
        # the persistent variant (bench/bench_fp8_down.py): its fastest tiles with 1x128 input groups
        fp8_grouped.grouped_block_mm(x, torch.empty(1024, k // 128), w, torch.empty(experts, n), offs, x_groups=True,
                                     w_blocks=False, bm=64, warps=4, stages=4, persistent=2 * HOPPER_SMS)
    assert_sound(launches, 5, matrix=True)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "moonlight", "deepseek-v3"])
def test_the_fused_fp8_expert_gate_up_kernel_at_each_expert_model(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """``ops.fp8_moe`` in each scale layout at each config. With 128x128 weight blocks and 1x128
    input groups each K block's two products are promoted apart from the accumulators (255
    registers at 128 rows): 8 bytes spill at Qwen3-30B-A3B's width, which still ran fastest
    (bench/bench_fp8_moe.py on an H100: 2.49 ms at 128 rows against 3.19 ms at 64), so up to 16
    bytes pass there; per-channel weights spill nothing."""
    monkeypatch.setattr(fp8_moe, "runs_on", lambda x: True)  # CUDA only
    hidden, experts, inter = EXPERT_SHAPES[model]
    experts = min(experts, 16)
    t, top, f8 = 1024, 8, torch.float8_e4m3fn
    x = torch.empty(t, hidden, dtype=f8)
    w = torch.empty(experts, 2 * inter, hidden, dtype=f8)
    tokens = torch.zeros(t * top, dtype=torch.int64)
    offs = torch.full((experts,), t * top, dtype=torch.int32)
    for config in fp8_moe.CONFIGS:
        for block in (False, True):
            sx = torch.empty(t, hidden // 128) if block else torch.empty(t, 1)
            sw = torch.empty(experts, 2 * inter // 128, hidden // 128) if block else torch.empty(experts, 2 * inter)
            with compiled_launches() as launches:  # (per-channel weights: the down input's scales powers of two)
                assert fp8_moe.gate_up_silu_quant(x, sx, tokens, offs, w, sw, x_groups=block, w_blocks=block,
                                                  config=config, pow2=not block) is not None
            if block and config[0] == 128:
                assert all(k.stack <= 16 for k in launches), [(k.stack, k.registers) for k in launches]
                launches = [dataclasses.replace(k, stack=0) for k in launches]
            assert_sound(launches, 1, matrix=True)


def test_the_down_inputs_rows_of_groups_at_each_expert_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops.fp8_moe.rows_of_groups`` at the intermediate widths of the expert models whose down
    input is made in 1x128 groups (I a multiple of 128)."""
    monkeypatch.setattr(fp8_moe, "runs_on", lambda x: True)  # CUDA only
    widths = sorted({i for _, _, i in EXPERT_SHAPES.values() if i % 128 == 0 and i > 128})
    with compiled_launches() as launches:
        for i in widths:
            fp8_moe.rows_of_groups(torch.empty(1024, i, dtype=torch.float8_e4m3fn), torch.empty(1024, i // 128))
    assert_sound(launches, len(widths), matrix=False)


@pytest.mark.parametrize("vocab", [151_936, 248_320])
def test_the_top_k_kernel_at_large_vocabularies(vocab: int) -> None:
    x = torch.empty(8, vocab)
    with compiled_launches() as launches:
        for k in (1, 64, top_k_ops.MAX_K):
            top_k_ops.top_k_triton(x, k)
    assert_sound(launches, 3, matrix=False)


def test_a_kernel_that_spills_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: DeepSeek-V3's router at 64 rows a program (what ``tokens_per_program``
    gave before it was cut by expert count) spills on sm_90."""
    monkeypatch.setattr(moe_router, "tokens_per_program", lambda e: 64)
    hidden, experts, groups, keep, top = ROUTERS["deepseek-v3"]
    with compiled_launches() as launches:
        moe_router.sigmoid_route(torch.empty(4096, hidden, dtype=BF), torch.empty(experts, hidden),
                                 torch.empty(experts), top, groups, keep, True, 2.5, any_size=True)
    with pytest.raises(AssertionError, match="spills registers"):
        assert_sound(launches, 1, matrix=False)


@pytest.mark.parametrize(("experts", "top"), [(64, 6), (256, 8), (512, 10)])  # Moonlight, DeepSeek-V3, Qwen3-Next
def test_the_expert_grouping_kernels_at_each_routing(experts: int, top: int) -> None:
    flat = torch.zeros(16384 * top, dtype=torch.int64)
    with compiled_launches() as launches:
        moe_group.group_kernels(flat, experts, top)
    assert_sound(launches, 2, matrix=False)


# (experts, top-k, renormalised): Mixtral, Qwen2-MoE, Qwen3-30B-A3B, Qwen3.5-35B-A3B, Qwen3-Next
@pytest.mark.parametrize(("experts", "top", "norm"),
                         [(8, 2, True), (60, 4, False), (128, 8, True), (256, 8, True), (512, 10, True)])
def test_the_softmax_routers_selection_at_each_router(experts: int, top: int, norm: bool) -> None:
    with compiled_launches() as launches:
        softmax_topk.softmax_topk(torch.empty(4096, experts), top, norm)
        # a layer with a gated shared expert: the router's columns of the [T, E + 1] logits
        softmax_topk.softmax_topk(torch.empty(4096, experts + 1)[:, :experts], top, norm)
    assert_sound(launches, 2, matrix=False)


# (experts, top-k): Moonlight, GLM-4.5, Kimi-K2's ungrouped sigmoid routing, with its score-correction bias
@pytest.mark.parametrize(("experts", "top"), [(64, 6), (128, 8), (384, 8)])
def test_the_sigmoid_routers_selection_at_each_router(experts: int, top: int) -> None:
    with compiled_launches() as launches:
        softmax_topk.sigmoid_topk(torch.empty(4096, experts), torch.empty(experts), top, True, 2.5)
    assert_sound(launches, 1, matrix=False)
