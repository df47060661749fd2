"""The engine's linear-attention state routing end to end on the CPU, with a stand-in
linear layer (``fake_linear``) in a dense checkpoint: a sequence split into chunks, and a
GRPO group served from the prompt's snapshot, score the same as one unchunked pass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fake_linear import hybrid_engine

from teacher_server.cache_layout import CacheLayout, LinearStateLayout
from teacher_server.config import Config
from teacher_server.engine.rank_setup import plan_memory
from teacher_server.engine.request import ScoreRequest
from teacher_server.layers.parallel import SINGLE
from teacher_server.models.spec import ModelSpec

BS = 8


def group(rng, prompt_len: int, n: int, resp_len: int, tag: str) -> list[ScoreRequest]:
    prompt = rng.integers(0, 512, prompt_len)
    out = []
    for i in range(n):
        toks = np.concatenate([prompt, rng.integers(0, 512, resp_len)])
        rows = len(toks) - prompt_len
        cand = np.stack([rng.choice(512, 4, replace=False) for _ in range(rows)])
        out.append(ScoreRequest(f"{tag}-{i}", toks, prompt_len - 1, cand, max_tokens=1))
    return out


def fresh(reqs: list[ScoreRequest], tag: str) -> list[ScoreRequest]:
    return [ScoreRequest(r.request_id + tag, r.token_ids, r.start, r.candidates, max_tokens=1) for r in reqs]


def assert_same(a, b, tol: float = 2e-5) -> None:
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        np.testing.assert_allclose(x.token_id_logprobs, y.token_id_logprobs, atol=tol, rtol=0)
        assert x.next_token == y.next_token


def test_state_carries_across_chunks_and_from_snapshots(checkpoints, monkeypatch) -> None:
    path = checkpoints["qwen3"]  # two layers: 0 becomes linear, 1 keeps attention (its KV in the pool)
    rng = np.random.default_rng(0)
    reqs = group(rng, 45, 4, 12, "a") + group(rng, 21, 3, 30, "b")
    common = dict(model=str(path), block_size=BS, num_kv_blocks=256, max_model_len=512, linear_state_slots=16)
    ref = hybrid_engine(monkeypatch, path, (0,), enable_prefix_caching=False, max_num_batched_tokens=4096,
                        **common).run_to_completion(reqs)
    chunked = hybrid_engine(monkeypatch, path, (0,), enable_prefix_caching=False, max_num_batched_tokens=16,
                            **common)
    assert_same(chunked.run_to_completion(reqs), ref)
    eng = hybrid_engine(monkeypatch, path, (0,), enable_prefix_caching=True, max_num_batched_tokens=64, **common)
    warm = eng.run_to_completion(reqs)
    assert_same(warm, ref)
    # one response per group computed its prompt and kept the state at cache_end (the last
    # block boundary before the first scored row); its siblings started from there
    assert sorted(w.cached_tokens for w in warm) == [0, 0, 16, 16, 40, 40, 40]
    st = eng.stats()
    assert (st.state_slots_total, st.state_slots_used, st.state_snapshots) == (16, 2, 2)
    again = eng.run_to_completion(fresh(reqs, "w"))  # later requests: every one from a snapshot
    assert_same(again, ref)
    assert sorted(w.cached_tokens for w in again) == [16] * 3 + [40] * 4
    pool = eng.runner.kv
    assert not pool.rec_state(0)[0].any() and not pool.conv_state(0)[0].any()  # slot 0 stays the zero state
    eng.reset_prefix_cache()
    assert eng.stats().state_slots_used == 0


def test_state_routing_matters(checkpoints, monkeypatch) -> None:
    """The check above can fail: starting the chunks after the first from the zero state
    changes the scores."""
    path = checkpoints["qwen3"]
    reqs = group(np.random.default_rng(1), 45, 1, 12, "c")
    common = dict(model=str(path), block_size=BS, num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)
    ref = hybrid_engine(monkeypatch, path, (0,), max_num_batched_tokens=4096, **common).run_to_completion(reqs)
    eng = hybrid_engine(monkeypatch, path, (0,), max_num_batched_tokens=16, **common)
    orig = eng.runner.execute

    def forget(hs, pacer):
        hs.state.state_in[:] = 0
        return orig(hs, pacer)

    eng.runner.execute = forget
    out = eng.run_to_completion(reqs)
    assert np.abs(out[0].token_id_logprobs - ref[0].token_id_logprobs).max() > 1e-3


def test_plan_memory_shares_memory_between_kv_and_state(checkpoints) -> None:
    """Automatic sizing on the CPU: the KV of the default token count, and state slots for
    2 * max_num_seqs sequences cut down to a quarter of the pool (KV and state), at least 2;
    an explicit slot count is taken as given; a dense model gets no slots."""
    dense = ModelSpec.from_dir(checkpoints["qwen3"])
    spec = dataclasses.replace(dense, layer_types=("linear_attention", "full_attention"))
    cfg = Config(device="cpu", max_num_seqs=8, block_size=BS)
    cpu, f32 = torch.device("cpu"), torch.float32
    cache = CacheLayout.uniform(dense.kv_layer_ids, dense.num_kv_heads, dense.head_dim, f32)
    kv_blocks, none, budget = plan_memory(cfg, dense, cache, cpu, 512, SINGLE)
    assert none == 0 and budget == 2048

    def sizes(rec: tuple[int, ...], **kw: object) -> tuple[int, int, int]:
        layout = LinearStateLayout(layers=(0,), conv_shape=(2, 8), rec_shape=rec, conv_dtype=f32)
        cache = CacheLayout.uniform(spec.kv_layer_ids, spec.num_kv_heads, spec.head_dim, f32, layout)
        return (*plan_memory(cfg.model_copy(update=kw), spec, cache, cpu, 512, SINGLE)[:2], layout.slot_bytes())

    blocks, slots, _ = sizes((2, 4, 4))
    assert (blocks, slots) == (kv_blocks, 16)  # small states: 2 * max_num_seqs
    kv_bytes = blocks * BS * 2 * len(spec.kv_layer_ids) * spec.num_kv_heads * spec.head_dim * 4
    blocks, slots, slot_bytes = sizes((4, 256, 256))
    assert 2 <= slots < 16 and slots * slot_bytes <= kv_bytes / 3 < (slots + 1) * slot_bytes
    assert sizes((64, 256, 256))[1] == 2  # at least a working slot and a snapshot
    assert sizes((64, 256, 256), linear_state_slots=5)[1] == 5


def test_start_up_warm_up_covers_state_paths_and_leaves_nothing_behind(checkpoints, monkeypatch) -> None:
    """``warm_up`` scores synthetic requests at start-up: they carry a sequence's state across
    chunks and start a response from a prompt's snapshot. Then the engine starts clean (no
    cached blocks or snapshots, zero counters), and its first requests get the same results and
    cache hits as on an engine built without it."""
    from teacher_server.engine.engine import Engine

    seen = []
    reset = Engine.reset_prefix_cache

    def spy(self) -> None:  # the counters just before the warm-up forgets its requests
        seen.append(self.stats())
        reset(self)

    monkeypatch.setattr(Engine, "reset_prefix_cache", spy)
    path = checkpoints["qwen3"]
    common = dict(model=str(path), block_size=BS, num_kv_blocks=256, max_model_len=512, linear_state_slots=16,
                  enable_prefix_caching=True, max_num_batched_tokens=64)
    cold = hybrid_engine(monkeypatch, path, (0,), warm_up=False, **common)
    assert cold.warm_up_s == 0 and not seen
    warm = hybrid_engine(monkeypatch, path, (0,), warm_up=True, **common)
    assert warm.warm_up_s > 0 and len(seen) == 1
    during = seen[0]
    assert during.steps >= 4 and during.prefix_hit_tokens > 0 and during.state_snapshots > 0
    st = warm.stats()
    assert (st.steps, st.computed_tokens, st.prefix_query_tokens, st.prefix_hit_tokens, st.kv_blocks_used,
            st.state_slots_used, st.state_snapshots, st.active_requests) == (0,) * 8
    assert st.timing.launch_s == 0
    rng = np.random.default_rng(1)
    reqs = group(rng, 45, 4, 12, "a") + group(rng, 21, 3, 30, "b")
    a, b = cold.run_to_completion(reqs), warm.run_to_completion(fresh(reqs, "w"))
    assert_same(b, a, tol=0)
    assert [x.cached_tokens for x in b] == [x.cached_tokens for x in a]


def test_a_failed_warm_up_closes_the_engine(checkpoints, monkeypatch) -> None:
    """A warm-up that fails stops the engine's start (the error is raised) and closes it, so
    tensor-parallel workers free their GPUs instead of outliving a start that failed."""
    from teacher_server.engine.engine import Engine

    closed = []

    def fail(self) -> float:
        raise RuntimeError("start-up warm-up failed: boom")

    monkeypatch.setattr(Engine, "warm_up", fail)
    monkeypatch.setattr(Engine, "close", lambda self: closed.append(self))
    with pytest.raises(RuntimeError, match="boom"):
        Engine(Config(model=str(checkpoints["qwen3"]), device="cpu", warm_up=True, max_num_batched_tokens=64))
    assert len(closed) == 1
