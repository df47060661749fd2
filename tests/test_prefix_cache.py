"""Prefix caching on the paged KV pool: results with cache hits equal results without."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

BS = 8


def engine(path, cache: bool, blocks: int = 256, budget: int = 64) -> Engine:
    return Engine(Config(model=str(path), device="cpu", enable_prefix_caching=cache, block_size=BS,
                         num_kv_blocks=blocks, max_num_batched_tokens=budget, max_model_len=512))


def group(rng, prompt_len: int, n: int, resp_len: int, per_row: bool, salt: str | None = None,
          tag: str = "") -> list[ScoreRequest]:
    prompt = rng.integers(0, 512, prompt_len)
    out = []
    for i in range(n):
        toks = np.concatenate([prompt, rng.integers(0, 512, resp_len)])
        start = prompt_len - 1
        rows = len(toks) - 1 - start
        cand = (np.stack([rng.choice(512, 5, replace=False) for _ in range(rows)]) if per_row
                else rng.choice(512, 5, replace=False))
        out.append(ScoreRequest(f"{tag}{prompt_len}-{i}", toks, start, cand, cache_salt=salt, max_tokens=1))
    return out


def assert_same(a, b, tol: float = 2e-5) -> None:
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        fin = np.isfinite(y.token_id_logprobs)
        np.testing.assert_array_equal(np.isfinite(x.token_id_logprobs), fin)
        np.testing.assert_allclose(x.token_id_logprobs[fin], y.token_id_logprobs[fin], atol=tol, rtol=0)
        assert x.next_token == y.next_token


@pytest.mark.parametrize("prompt_len", [BS * 4 - 1, BS * 4, BS * 4 + 1, BS * 4 + 5, 3])
@pytest.mark.parametrize("per_row", [False, True])
def test_hits_equal_no_cache(checkpoints, prompt_len, per_row) -> None:
    """start (= prompt_len - 1) inside, at, and past a block boundary."""
    path = checkpoints["qwen3"]
    reqs = group(np.random.default_rng(prompt_len), prompt_len, 4, 20, per_row)
    cold = engine(path, cache=False).run_to_completion(reqs)
    eng = engine(path, cache=True)
    first = eng.run_to_completion(reqs[:1])
    warm = eng.run_to_completion([ScoreRequest(r.request_id + "w", r.token_ids, r.start, r.candidates,
                                               max_tokens=1) for r in reqs])
    assert_same(first + warm[1:], cold)
    assert_same(warm, cold)
    expect = ((prompt_len - 1) // BS) * BS
    assert all(w.cached_tokens == expect for w in warm)
    assert all(c.cached_tokens == 0 for c in cold)


def test_group_arriving_together_shares_prompt(checkpoints) -> None:
    path = checkpoints["llama"]
    rng = np.random.default_rng(0)
    reqs = [r for g in range(3) for r in group(rng, 60, 4, 15, per_row=g % 2 == 0, tag=f"g{g}-")]
    cold = engine(path, cache=False, budget=512).run_to_completion(reqs)
    eng = engine(path, cache=True, budget=512)
    warm = eng.run_to_completion(reqs)
    assert_same(warm, cold)
    cached = [w.cached_tokens for w in warm]
    assert sorted(cached) == [0] * 3 + [56] * 9  # one computes each prompt, its siblings reuse it


def test_group_responses_share_one_attention_call_over_their_prompt(checkpoints) -> None:
    """Two GRPO groups through the engine with the cuDNN backend's planning (float32 math
    in place of cuDNN): each step puts a group's responses side by side with how many
    prompt keys they share, the backend scores their queries against the prompt in one
    call, and the results equal the engine without cache."""
    from attn_util import CpuCudnn

    path = checkpoints["qwen3"]
    rng = np.random.default_rng(4)
    reqs = [r for g in range(2) for r in group(rng, 150, 4, 40 + 9 * g, per_row=g == 1, tag=f"g{g}-")]
    cold = engine(path, cache=False, budget=1024).run_to_completion(reqs)
    eng = engine(path, cache=True, budget=1024)
    be = CpuCudnn(8)
    eng.tuning = replace(eng.tuning, attention=be)
    warm = eng.run_to_completion(reqs)
    assert_same(warm, cold)
    assert sorted(w.cached_tokens for w in warm) == [0] * 2 + [144] * 6
    grouped = [it for _, items in be.plans for it in items if type(it).__name__ == "Group"]
    assert sorted(len(it.cs) for it in grouped) == [3, 3] and all(it.s == 128 for it in grouped)
    assert [144, 144] in [shared[1:3] for shared, _ in be.plans]


def test_groups_whose_prompts_share_first_blocks_stay_apart(checkpoints) -> None:
    """Two cached prompts with the same first 16 tokens (two blocks), and responses of
    interleaved lengths from both in one step: the runner puts each prompt's responses side
    by side (ordered by the blocks they read, not by length), so each group takes one call
    over its own 144 prompt keys; results equal the engine without cache."""
    from attn_util import CpuCudnn

    path = checkpoints["qwen3"]
    rng = np.random.default_rng(5)
    common = rng.integers(0, 512, 16)
    prompts = [np.concatenate([common, rng.integers(0, 512, 134)]) for _ in range(2)]
    lens = [[40, 30, 20], [35, 25, 15]]

    def req(g: int, i: int, n: int, tag: str) -> ScoreRequest:
        toks = np.concatenate([prompts[g], np.random.default_rng(10 * g + i).integers(0, 512, n)])
        return ScoreRequest(f"{tag}{g}-{i}", toks, 149, np.arange(5) * 7, max_tokens=1)

    leaders = [req(g, 0, 5, "lead") for g in range(2)]
    reqs = [req(g, i, n, "r") for g in range(2) for i, n in enumerate(lens[g])]
    cold = engine(path, cache=False, budget=1024).run_to_completion(reqs)
    eng = engine(path, cache=True, budget=1024)
    eng.run_to_completion(leaders)  # both prompts cached
    be = CpuCudnn(8)
    eng.tuning = replace(eng.tuning, attention=be)
    warm = eng.run_to_completion(reqs)
    assert_same(warm, cold)
    assert [w.cached_tokens for w in warm] == [144] * 6
    assert len(be.plans) == 1
    shared, items = be.plans[0]
    assert shared == [0, 144, 144, 16, 144, 144], shared
    groups = [it for it in items if type(it).__name__ == "Group"]
    assert [len(it.cs) for it in groups] == [3, 3] and all(it.s == 128 for it in groups), items


def test_salts_never_share(checkpoints) -> None:
    path = checkpoints["qwen2"]
    rng = np.random.default_rng(1)
    base = group(rng, 40, 1, 10, per_row=False)[0]
    eng = engine(path, cache=True)
    mk = lambda rid, salt: ScoreRequest(rid, base.token_ids, base.start, base.candidates, cache_salt=salt)  # noqa: E731
    a, b, c, d = eng.run_to_completion([mk("a", "tenant-a")] ) + eng.run_to_completion(
        [mk("b", "tenant-b")]) + eng.run_to_completion([mk("c", "tenant-a")]) + eng.run_to_completion([mk("d", None)])
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens, d.cached_tokens) == (0, 0, 32, 0)
    assert_same([b, c, d], [a, a, a])


def test_eviction_under_pressure(checkpoints) -> None:
    """A pool of 70 blocks (560 tokens) and many distinct groups with long, chunked
    sequences: cached blocks are evicted while others run; no result is corrupted."""
    path = checkpoints["mistral"]
    rng = np.random.default_rng(2)
    reqs = []
    for g in range(6):
        reqs += group(rng, int(rng.integers(20, 200)), 3, int(rng.integers(5, 250)), per_row=g % 2 == 1, tag=f"e{g}-")
    cold = engine(path, cache=False, blocks=70, budget=48).run_to_completion(reqs)
    eng = engine(path, cache=True, blocks=70, budget=48)
    for _ in range(2):  # the second pass hits what the first left, and evicts more
        warm = eng.run_to_completion([ScoreRequest(r.request_id + f"-{_}", r.token_ids, r.start, r.candidates,
                                                   max_tokens=1) for r in reqs])
        assert_same(warm, cold)
    stats = eng.stats()
    assert stats.kv_blocks_used == 0 and stats.active_requests == 0  # nothing leaked
    assert stats.prefix_hit_tokens > 0


def test_cache_can_be_turned_off(checkpoints) -> None:
    path = checkpoints["qwen3"]
    reqs = group(np.random.default_rng(3), 50, 3, 10, per_row=False)
    eng = engine(path, cache=False)
    res = eng.run_to_completion(reqs) + eng.run_to_completion(
        [ScoreRequest(r.request_id + "x", r.token_ids, r.start, r.candidates) for r in reqs])
    assert all(r.cached_tokens == 0 for r in res)


def test_no_salt_and_empty_salt_hash_apart() -> None:
    from teacher_server.engine.block_manager import block_hashes

    t = np.arange(32)
    assert block_hashes(t, 2, 16, None) != block_hashes(t, 2, 16, "")


def test_a_salt_of_any_str_is_hashed(checkpoints) -> None:
    """A salt UTF-8 cannot encode strictly (a lone surrogate, a str the Python API takes) is
    hashed as any other, apart from its neighbours: it had raised inside the scheduler, after
    the step's earlier sequences had taken their blocks, and every later step raised again."""
    from teacher_server.engine.block_manager import block_hashes

    t = np.arange(32)
    assert len({tuple(block_hashes(t, 2, 16, s)) for s in ("bad\udc80", "bad\udc81", "bad", None)}) == 4
    base = group(np.random.default_rng(4), 40, 1, 10, per_row=False)[0]
    eng = engine(checkpoints["qwen2"], cache=True)
    mk = lambda rid, salt: ScoreRequest(rid, base.token_ids, base.start, base.candidates, cache_salt=salt)  # noqa: E731
    a, b = eng.run_to_completion([mk("a", "ok"), mk("b", "bad\udc80")])
    c = eng.run_to_completion([mk("c", "bad\udc80")])[0]
    assert a.error is None and b.error is None and c.cached_tokens == 32
    assert_same([b, c], [a, a])
    assert eng.stats().kv_blocks_used == 0


def test_tuning_switches_the_cache_and_the_budget(checkpoints) -> None:
    """The switches a built engine takes (the benchmark's ablations): with the cache off
    and a 16-token budget nothing is reused and steps hold at most 16 tokens; restored,
    the cache serves the group's prompt again and the scores agree."""
    path = checkpoints["qwen3"]
    reqs = group(np.random.default_rng(6), 50, 3, 10, per_row=False)
    eng = engine(path, cache=True)
    saved = eng.tuning
    eng.tuning = replace(saved, prefix_caching=False, token_budget=16)
    off = eng.run_to_completion(reqs)
    assert all(r.cached_tokens == 0 for r in off)
    assert eng.stats().steps >= -(-sum(len(r.token_ids) - 1 for r in reqs) // 16)
    eng.tuning = saved
    assert eng.tuning == saved
    on = eng.run_to_completion([ScoreRequest(r.request_id + "x", r.token_ids, r.start, r.candidates, max_tokens=1)
                                for r in reqs])
    # nothing was cached while off: one computes the prompt, its siblings reuse its 6 blocks
    assert sorted(r.cached_tokens for r in on) == [0, 48, 48]
    assert_same(on, off)


def test_whole_sequence_packing_scores_as_splitting_does(checkpoints) -> None:
    """Sequences that fit a step are taken whole (whole_fill 0.5) instead of split to fill
    one (1.0): the same scores, and fewer chunks over pooled keys (steps may be more)."""
    path = checkpoints["qwen3"]
    rng = np.random.default_rng(11)
    reqs = [ScoreRequest(f"w{i}", rng.integers(0, 512, n), n // 2, rng.integers(0, 512, (n - 1 - n // 2, 4)))
            for i, n in enumerate([41, 41, 21, 31, 13, 21])]  # 40, 40, 20, 30, 12, 20 tokens to compute
    chunks: dict[float, int] = {}
    res = {}
    for fill in (1.0, 0.5):  # the setting from the config (0.5 is its default)
        kw = {} if fill == 0.5 else {"whole_sequence_fill": fill}
        eng = Engine(Config(model=str(path), device="cpu", enable_prefix_caching=False, block_size=BS,
                            num_kv_blocks=256, max_num_batched_tokens=64, max_model_len=512, **kw))
        assert eng.tuning.whole_fill == fill
        sched = eng._scheduler
        orig, seen = sched.schedule, []

        def schedule(orig=orig, seen=seen) -> list:
            seen.append(orig())
            return seen[-1]

        sched.schedule = schedule
        res[fill] = eng.run_to_completion([ScoreRequest(f"{r.request_id}-{fill}", r.token_ids, r.start,
                                                        r.candidates) for r in reqs])
        sched.schedule = orig
        chunks[fill] = sum(1 for step in seen for c in step if c.start > 0)  # chunks after a split
    assert chunks[1.0] > chunks[0.5] == 0, chunks
    assert_same(res[0.5], res[1.0])
