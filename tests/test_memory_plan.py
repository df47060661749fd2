"""The token budget and KV pool that start-up plans from a GPU's free memory (``plan_memory``),
on the CPU with the GPU's memory query answered by the test: the model shapes of the benchmarks,
GPU sizes of 80 and 141 GB."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from workloads import QWEN3_5_9B, QWEN3_8B, QWEN3_32B

from teacher_server.cache_layout import CacheLayout, LinearStateLayout
from teacher_server.config import Config
from teacher_server.engine.rank_setup import ACT_SHARE, AUTO_BUDGETS, activation_bytes, plan_memory
from teacher_server.layers.parallel import SINGLE, TensorParallel
from teacher_server.models.registry import model_class
from teacher_server.models.spec import ModelSpec

GB = 10**9
CUDA = torch.device("cuda")  # only its type is read: the memory query is the test's
BF16 = torch.bfloat16
WEIGHTS = {"8b": 16.4 * GB, "32b": 65.5 * GB}
SPECS = {"8b": ModelSpec.from_dict(QWEN3_8B), "32b": ModelSpec.from_dict(QWEN3_32B)}


def cache_of(spec: ModelSpec, tp: TensorParallel = SINGLE, state: LinearStateLayout | None = None) -> CacheLayout:
    """What the model declares it caches, this rank (the model built on the meta device: no
    memory), with the linear-state layout ``state``."""
    model = model_class(spec.architecture)(spec, BF16, torch.device("meta"), tied=False, tp=tp)
    return dataclasses.replace(model.cache_layout(), state=state)


def plan(monkeypatch, spec: ModelSpec, total: float, free: float, tp: TensorParallel = SINGLE, state=None,
         max_len: int = 40960, **kw: object):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free), int(total)))
    cfg = Config(device="cuda", **kw)
    return cfg, plan_memory(cfg, spec, cache_of(spec, tp, state), CUDA, max_len, tp)


def kv_bytes_per_token(spec: ModelSpec, tp: TensorParallel = SINGLE) -> int:
    return 2 * len(spec.kv_layer_ids) * tp.rows(spec.num_kv_heads, "kv heads")[1] * spec.head_dim * 2


def room(cfg: Config, total: float, free: float) -> float:
    return free - (1 - cfg.gpu_memory_utilization) * total - (1 << 30)


@pytest.mark.parametrize("size,total,want", [("8b", 141 * GB, 32768), ("8b", 80 * GB, 32768),
                                             ("8b", 48 * GB, 16384), ("32b", 141 * GB, 32768),
                                             ("32b", 100 * GB, 16384)])
def test_budget_follows_the_memory_and_the_pool_fills_the_rest(monkeypatch, size, total, want) -> None:
    """Qwen3-8B takes the larger step on an 80 or 141 GB GPU, not on a 48 GB one; Qwen3-32B on
    a 141 GB one, not on a 100 GB one, where its activations at 32768 tokens (the logits chunk
    included) would be more than 40% of what its weights leave. The KV pool is what the
    activations leave, to a block."""
    spec = SPECS[size]
    free = total - WEIGHTS[size]
    cfg, p = plan(monkeypatch, spec, total, free)
    assert p.budget == want and p.slots == 0
    left = room(cfg, total, free) - activation_bytes(cfg, spec, p.budget, 40960, SINGLE, cache_of(spec))
    assert p.blocks == int(left // kv_bytes_per_token(spec)) // cfg.block_size


def test_budget_never_shrinks_as_memory_grows_and_never_crowds_the_pool(monkeypatch) -> None:
    spec = SPECS["8b"]
    seen = []
    for free_gb in range(20, 142, 3):
        cfg, p = plan(monkeypatch, spec, 141 * GB, free_gb * GB)
        r = room(cfg, 141 * GB, free_gb * GB)
        act = activation_bytes(cfg, spec, p.budget, 40960, SINGLE, cache_of(spec))
        kv = p.blocks * cfg.block_size * kv_bytes_per_token(spec)
        if p.budget != AUTO_BUDGETS[-1]:  # a larger step only where it leaves the pool 4 steps
            assert act <= ACT_SHARE * r and p.blocks * cfg.block_size >= 4 * p.budget
        if kv >= 4 * AUTO_BUDGETS[-1] * kv_bytes_per_token(spec):
            assert act + kv <= r
        seen.append(p.budget)
    assert seen == sorted(seen) and seen[0] == 16384 and seen[-1] == 32768


def test_too_little_memory_keeps_the_smaller_budget_and_warns(monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        _, p = plan(monkeypatch, SPECS["32b"], 80 * GB, 6 * GB)
    assert p.budget == 16384 and p.blocks == 1
    assert "tokens of KV fit in GPU memory" in caplog.text


def test_a_configured_budget_or_pool_is_taken_as_given(monkeypatch) -> None:
    """``max_num_batched_tokens`` is the budget whatever the memory; with ``num_kv_blocks`` the
    larger budget needs room beside that pool."""
    for tokens in (16, 8192, 65536):
        assert plan(monkeypatch, SPECS["8b"], 141 * GB, 20 * GB, max_num_batched_tokens=tokens)[1].budget == tokens
    cfg, p = plan(monkeypatch, SPECS["8b"], 141 * GB, 124.6 * GB, num_kv_blocks=1000)
    assert p == (1000, 0, 32768)
    huge = int(room(cfg, 141 * GB, 124.6 * GB) * 0.9 // kv_bytes_per_token(SPECS["8b"]) // cfg.block_size)
    assert plan(monkeypatch, SPECS["8b"], 141 * GB, 124.6 * GB, num_kv_blocks=huge)[1] == (huge, 0, 16384)


def test_tensor_parallel_rank_plans_its_shares(monkeypatch) -> None:
    """A rank's activations and KV are its shares: Qwen3-32B split in two on 80 GB GPUs takes
    the larger step (on one it does not fit at all), each rank's KV bytes per token halved."""
    tp = TensorParallel(2, 1)
    spec = SPECS["32b"]
    cfg, p = plan(monkeypatch, spec, 80 * GB, 80 * GB - WEIGHTS["32b"] / 2, tp=tp)
    assert p.budget == 32768
    assert kv_bytes_per_token(spec, tp) * 2 == kv_bytes_per_token(spec)
    left = room(cfg, 80 * GB, 80 * GB - WEIGHTS["32b"] / 2) - activation_bytes(cfg, spec, 32768, 40960, tp, cache_of(spec, tp))
    assert p.blocks == int(left // kv_bytes_per_token(spec, tp)) // cfg.block_size


def test_hybrid_model_plans_state_slots_with_the_budget(monkeypatch) -> None:
    """Qwen3.5-9B's shape: the state slots (a quarter of the pool at most) and the KV share the
    pool the larger step leaves on a 141 GB GPU."""
    spec = ModelSpec.from_dict(QWEN3_5_9B)
    layout = LinearStateLayout(layers=spec.linear_layer_ids, conv_shape=(8192, 3), rec_shape=(32, 128, 128),
                               conv_dtype=BF16)
    cfg, p = plan(monkeypatch, spec, 141 * GB, 122 * GB, state=layout, max_len=32768)
    left = room(cfg, 141 * GB, 122 * GB) - activation_bytes(cfg, spec, 32768, 32768, SINGLE, cache_of(spec, state=layout))
    assert p.budget == 32768 and p.slots == min(2 * cfg.max_num_seqs, int(left / 4 // layout.slot_bytes()))
    assert p.blocks == int((left - p.slots * layout.slot_bytes()) // kv_bytes_per_token(spec)) // cfg.block_size


def test_expert_rows_are_counted_at_their_split(monkeypatch) -> None:
    """An expert model's step holds k rows per token through its expert layers (the gathered
    input, gate/up, SiLU-mul, the output): counted at this rank's expert width, the whole
    experts' under expert parallel (TP2: the tensor split's share is half)."""
    from workloads import QWEN3_30B_A3B

    spec = ModelSpec.from_dict(QWEN3_30B_A3B)
    dense = dataclasses.replace(spec, num_experts=0)
    tp, ep = TensorParallel(2, 0), TensorParallel(2, 0, moe="expert")
    cfg = Config(device="cuda")
    base = activation_bytes(cfg, dense, 8192, 8192, tp, cache_of(spec, tp))
    per_row = spec.num_experts_per_tok * 8192 * 4
    split = activation_bytes(cfg, spec, 8192, 8192, tp, cache_of(spec, tp)) - base
    whole = activation_bytes(cfg, spec, 8192, 8192, ep, cache_of(spec, tp)) - base
    assert split == per_row * (2 * spec.hidden_size + 3 * spec.moe_intermediate_size // 2)
    assert whole == per_row * (2 * spec.hidden_size + 3 * spec.moe_intermediate_size)


def test_deepseek_routers_bf16_parts_are_counted() -> None:
    """DeepSeek's float32 routers may hold their weight as bf16 parts too (``ops.split_gemm``,
    made at warm-up, after the plan): 3 x E x H bf16 values per expert layer, counted."""
    from teacher_server.benchmark.workloads import MOONLIGHT_16B_A3B as MOONLIGHT

    spec = ModelSpec.from_dict(MOONLIGHT)
    assert spec.routing is not None
    cfg = Config(device="cuda")
    without = activation_bytes(cfg, dataclasses.replace(spec, routing=None), 8192, 8192, SINGLE, cache_of(spec))
    layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    assert layers == spec.num_layers - 1  # (Moonlight's first layer is dense)
    assert activation_bytes(cfg, spec, 8192, 8192, SINGLE, cache_of(spec)) - without == layers * 3 * 64 * 2048 * 2
