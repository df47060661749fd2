"""The routing policy shared by the server's replica front and the client (plain Python)."""

from __future__ import annotations

import numpy as np

from teacher_server.routing import STICKY_RATIO, STICKY_SPILLS, Router, prefix_key, rendezvous, reusable_tokens


def _group_key(rng: np.random.Generator, router: Router, prompt_len: int, salt: str | None = None) -> bytes | None:
    prompt = rng.integers(0, 50_000, prompt_len)
    return router.key(np.concatenate([prompt, rng.integers(0, 50_000, 100)]), reusable_tokens(prompt_len - 1), salt)


def _placements(rng: np.random.Generator, groups: int, members: int, prompt_len: tuple[int, int],
                prefix: np.ndarray | None = None) -> dict[int, set[str]]:
    """The replicas (of 4, none loaded) each of ``groups`` GRPO groups went to: ``members``
    responses of varied length to one prompt of ``prompt_len`` tokens after ``prefix``, the
    scored rows starting after the prompt."""
    router = Router()
    names = [str(i) for i in range(4)]
    chosen: dict[int, set[str]] = {}
    for g in range(groups):
        prompt = rng.integers(0, 50_000, int(rng.integers(*prompt_len)))
        prompt = prompt if prefix is None else np.concatenate([prefix, prompt])
        for _ in range(members):
            seq = np.concatenate([prompt, rng.integers(0, 50_000, int(rng.integers(1, 200)))])
            key = router.key(seq, reusable_tokens(len(prompt) - 1), None)
            chosen.setdefault(g, set()).add(router.pick(key, dict.fromkeys(names, 0)))
    return chosen


def test_every_member_of_a_group_goes_to_one_replica() -> None:
    chosen = _placements(np.random.default_rng(0), 64, 8, (40, 300))
    assert all(len(c) == 1 for c in chosen.values()), chosen
    spread = {next(iter(c)) for c in chosen.values()}
    assert spread == {"0", "1", "2", "3"}, spread  # 64 groups land on every one of 4 replicas


def test_prompts_sharing_a_long_system_prompt_spread_over_the_replicas() -> None:
    """32 groups whose prompts open with one 300-token system prompt: 32 keys over 4 replicas,
    each group whole on one (the key had covered the first 256 tokens: one key, one replica,
    the others idle)."""
    rng = np.random.default_rng(5)
    system = rng.integers(0, 50_000, 300)
    chosen = _placements(rng, 32, 4, (50, 300), prefix=system)
    assert all(len(c) == 1 for c in chosen.values()), chosen
    assert {next(iter(c)) for c in chosen.values()} == {"0", "1", "2", "3"}


def test_key_covers_full_blocks_and_salt_only() -> None:
    toks = np.arange(100)
    assert prefix_key(toks, 15, block_size=16) is None  # no full block before the first scored row
    assert prefix_key(toks, 20, block_size=16) == prefix_key(toks, 31, block_size=16)  # same full blocks
    assert prefix_key(toks, 20, block_size=16) != prefix_key(toks, 32, block_size=16)
    assert prefix_key(toks, 20, "a") != prefix_key(toks, 20, "b")  # tenants never share a key
    other = toks.copy()
    other[50:] += 1  # differs only past the reusable prefix
    assert prefix_key(toks, 48, block_size=16) == prefix_key(list(other), 48, block_size=16)
    assert reusable_tokens(40, prompt_logprobs=5) == 0  # every position is scored


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    rng = np.random.default_rng(1)
    keys = [prefix_key(rng.integers(0, 1000, 32), 32) for _ in range(300)]
    before = {k: rendezvous(k, ["a", "b", "c"]) for k in keys}
    after = {k: rendezvous(k, ["a", "c"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b" for k in moved)


def test_a_new_prefix_spills_to_the_least_loaded_replica_past_the_threshold() -> None:
    rng = np.random.default_rng(2)
    router = Router(spill_tokens=1000)
    keys = [_group_key(rng, router, 200) for _ in range(2)]
    preferred = rendezvous(keys[0], ["0", "1"])
    other = "1" if preferred == "0" else "0"
    while rendezvous(keys[1], ["0", "1"]) != preferred:  # a second new key with the same preference
        keys[1] = _group_key(rng, router, 200)
    # up to the threshold a new group goes where the rendezvous hash puts it, past it elsewhere
    assert router.pick(keys[0], {preferred: 500 + 1000, other: 500}) == preferred
    assert router.pick(keys[1], {preferred: 500 + 1001, other: 500}) == other
    assert router.pick(None, {preferred: 10, other: 5}) == other  # no reusable prefix: least loaded


def test_a_placed_prefix_stays_until_its_replica_is_far_more_loaded() -> None:
    rng = np.random.default_rng(4)
    router = Router(spill_tokens=1000)
    key = _group_key(rng, router, 200)
    first = router.pick(key, {"0": 0, "1": 0})
    other = "1" if first == "0" else "0"
    # past the spill threshold, the group's later members still follow its first
    busy = int(STICKY_RATIO * 500) + STICKY_SPILLS * 1000  # past 500 + 1000, up to the sticky bound
    assert router.pick(key, {first: busy, other: 500}) == first
    # far more loaded: the key is placed again, on the least loaded, and stays there
    far = int(STICKY_RATIO * 500) + STICKY_SPILLS * 1000 + 1
    assert router.pick(key, {first: far, other: 500}) == other
    assert router.pick(key, {first: 0, other: 0}) == other
    # a replica that is gone: placed again among those present
    assert router.pick(key, {first: 0}) == first


def test_a_batch_of_new_prompts_spreads_evenly() -> None:
    """A W1-like batch (64 new prompts of 4-12k tokens, all sent before any is answered): the
    replicas end within one request plus the spill bound of each other, since the batch takes
    as long as the most loaded one (a 1.25x ratio bound let them drift 20% apart)."""
    rng = np.random.default_rng(6)
    router = Router()
    load = {"0": 0, "1": 0}
    sizes = rng.integers(4096, 12289, 64)
    for n in sizes:
        prompt = rng.integers(0, 50_000, int(n))
        r = router.pick(router.key(prompt, reusable_tokens(int(n) // 4), None), dict(load))
        load[r] += int(n)
    assert abs(load["0"] - load["1"]) <= router.spill_tokens + int(sizes.max()), load


def test_round_robin_ignores_prefix_and_load() -> None:
    rng = np.random.default_rng(3)
    router = Router("round_robin")
    key = _group_key(rng, router, 200)
    picks = [router.pick(key, {"0": 0, "1": 10**9}) for _ in range(6)]
    assert sorted(picks) == ["0"] * 3 + ["1"] * 3


def test_groups_stay_whole_under_a_closed_loop_load() -> None:
    """A G1-like stream (groups of 8-16 responses of 512-4096 tokens after prompts of
    1024-2048, sent in order by 128 clients: each answer lets the next request go) over two
    replicas: every group lands on one replica while the load moves, and both replicas carry
    a fair share of the tokens. (Spills decided per request split some of these groups.)"""
    from collections import deque

    rng = np.random.default_rng(5)
    router = Router()
    load = {"0": 0, "1": 0}
    inflight: deque[tuple[str, int]] = deque()
    placed: dict[int, set[str]] = {}
    served = {"0": 0, "1": 0}
    for g in range(48):
        plen = int(rng.integers(1024, 2049))
        prompt = rng.integers(0, 50_000, plen)
        key = router.key(prompt, reusable_tokens(plen - 1), None)
        for _ in range(int(rng.integers(8, 17))):
            tokens = plen + int(rng.integers(512, 4097))
            if len(inflight) == 128:  # the oldest is answered (both replicas work at the same pace)
                r, n = inflight.popleft()
                load[r] -= n
            r = router.pick(key, dict(load))
            load[r] += tokens
            served[r] += tokens
            inflight.append((r, tokens))
            placed.setdefault(g, set()).add(r)
    assert all(len(p) == 1 for p in placed.values()), {g: p for g, p in placed.items() if len(p) > 1}
    share = served["0"] / (served["0"] + served["1"])
    assert 0.3 < share < 0.7, share
