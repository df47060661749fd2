"""Qwen3.5 teachers end to end on the CPU: the engine's matrix equals transformers' float32 one
for the dense, the MoE and the vision-language checkpoints (flat and per-row candidates, edge
starts, sequences split into many chunks, classic prompt_logprobs), and the linear layers'
state is carried exactly: across chunks, from a GRPO group's prompt snapshot to its siblings
(same results as with the prefix cache off), apart across cache salts, and through eviction of
state slots and KV blocks under a small budget."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_util import around_forward
from reference import HYBRID_FAMILIES, reference_logprobs, reference_scores, torch_reference_kernels
from test_parity import TOL, VOCAB, check, make_requests

from teacher_server import LLM, SamplingParams, TokensPrompt
from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.models.spec import ModelSpec

BS = 8  # block size of these tests: a 45-token prompt is five full blocks and a part


def engine(path, budget: int = 32, cache: bool = True, blocks: int = 256, **kw) -> Engine:
    """A CPU engine of 8-token blocks; max_model_len is what ``blocks`` hold (at most 2048)."""
    return Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=budget, block_size=BS,
                         num_kv_blocks=blocks, max_model_len=min(2048, blocks * BS), enable_prefix_caching=cache,
                         **kw))


def group(rng: np.random.Generator, prompt_len: int, n: int, resp_len: int, per_row: bool, tag: str,
          salt: str | None = None) -> list[ScoreRequest]:
    """One GRPO group: ``n`` responses of ``resp_len`` + j tokens after one prompt, scored from
    the last prompt token (start = prompt_len - 1)."""
    prompt = rng.integers(0, VOCAB, prompt_len)
    out = []
    for j in range(n):
        toks = np.concatenate([prompt, rng.integers(0, VOCAB, resp_len + j)])
        rows = len(toks) - prompt_len
        cand = (np.stack([rng.choice(VOCAB, 5, replace=False) for _ in range(rows)]) if per_row
                else rng.choice(VOCAB, 5, replace=False))
        out.append(ScoreRequest(f"{tag}-{j}", toks, prompt_len - 1, cand, cache_salt=salt, max_tokens=1))
    return out


def again(reqs: list[ScoreRequest], tag: str) -> list[ScoreRequest]:
    """The same requests under new ids (a second pass over an engine that has seen them)."""
    return [ScoreRequest(r.request_id + tag, r.token_ids, r.start, r.candidates, cache_salt=r.cache_salt,
                         max_tokens=1) for r in reqs]


def assert_same(a, b, tol: float = 5e-5) -> None:
    """Two runs of the same requests agree within float32 rounding: a different batching, and
    the linear layers' chunked rule summing at other chunk boundaries when a sequence starts
    from a snapshot or is cut at the reuse boundary."""
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        fin = np.isfinite(y.token_id_logprobs)
        np.testing.assert_array_equal(np.isfinite(x.token_id_logprobs), fin)
        np.testing.assert_allclose(x.token_id_logprobs[fin], y.token_id_logprobs[fin], atol=tol, rtol=0)
        assert x.next_token == y.next_token


def cache_end(prompt_len: int) -> int:
    """Where a group's shared state is saved: the last block boundary at or before its first
    scored row (start = prompt_len - 1)."""
    return (prompt_len - 1) // BS * BS


# --- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_parity_cpu(family: str, checkpoints) -> None:
    """float32 within 1e-4 of transformers: flat and per-row candidates, starts at 0, inside,
    at and past the end, sequences of up to 150 tokens in chunks of a 32-token budget."""
    path = checkpoints[family]
    reqs = make_requests(np.random.default_rng(sum(map(ord, family))))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_spec_reads_the_hybrid_facts(checkpoints) -> None:
    """The config.json of each checkpoint (the VL one through its text_config) gives the
    layer pattern and linear sizes the checkpoints were made with."""
    dense, moe, vl = (ModelSpec.from_dir(checkpoints[f]) for f in HYBRID_FAMILIES)
    assert dense.linear_layer_ids == (0, 2) and dense.kv_layer_ids == (1, 3) and dense.rotary_dim == 4
    assert moe.linear_layer_ids == (0, 1, 2) and moe.kv_layer_ids == (3,) and moe.rotary_dim == 8
    assert moe.num_experts == 8 and moe.num_experts_per_tok == 2
    assert vl.layer_types == dense.layer_types and vl.hidden_size == dense.hidden_size
    cfg = json.loads((checkpoints["qwen3_5_vl"] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in cfg


def test_vision_language_reference_is_transformers_own(checkpoints) -> None:
    """The reference the VL checkpoint is checked against (its text model) is what
    transformers' ``Qwen3_5ForConditionalGeneration`` computes on token ids."""
    import transformers as tf

    path = checkpoints["qwen3_5_vl"]
    vl = tf.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    toks = np.random.default_rng(1).integers(0, VOCAB, 70).tolist()
    with torch.no_grad(), torch_reference_kernels():
        lp = torch.log_softmax(vl(torch.tensor([toks])).logits[0].double(), -1).numpy()
    np.testing.assert_allclose(lp, reference_logprobs(path, toks), atol=1e-5, rtol=0)


def test_prompt_logprobs_through_the_llm(checkpoints) -> None:
    """The in-process API: classic prompt_logprobs (the actual token first, then the top-k by
    rank) and per-row candidates in one request, both against transformers."""
    path = checkpoints["qwen3_5"]
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=16, block_size=BS, num_kv_blocks=128,
              max_model_len=512)
    toks = np.random.default_rng(3).integers(0, VOCAB, 60).tolist()
    start = 20
    cand = [[toks[start + i + 1]] for i in range(len(toks) - 1 - start)]  # K=1: the actual tokens
    (out,) = llm.generate(TokensPrompt(prompt_token_ids=toks),
                          SamplingParams(max_tokens=0, prompt_logprobs=5, prompt_logprob_token_ids=cand,
                                         prompt_logprob_start=start))
    ref = reference_logprobs(path, toks)  # [L, V]: row p predicts token p + 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(toks)
    for p in range(1, len(toks)):
        entry = out.prompt_logprobs[p]
        first = next(iter(entry))
        assert first == toks[p]  # the actual token is the first key
        assert abs(entry[first].logprob - ref[p - 1, toks[p]]) < TOL
        assert entry[first].rank == int((ref[p - 1] > ref[p - 1, toks[p]]).sum()) + 1
        top = np.argsort(-ref[p - 1], kind="stable")[:5]
        for t in top:
            assert abs(entry[int(t)].logprob - ref[p - 1, t]) < TOL
    np.testing.assert_allclose(out.prompt_token_id_logprobs[:, 0], ref[start + np.arange(len(cand)),
                                                                       toks[start + 1:]], atol=TOL)


def test_long_sequence_in_many_chunks_in_bounded_memory(checkpoints) -> None:
    """One 1000-token sequence at a 40-token budget: 25 steps, none over the budget, with only
    the KV blocks its full-attention layers need and two state slots; every row still
    matches transformers (the state crosses every chunk boundary)."""
    path = checkpoints["qwen3_5"]
    n = 1000
    eng = engine(path, budget=40, blocks=n // BS + 2, cache=False, linear_state_slots=2)
    steps: list[int] = []
    around_forward(eng, before=lambda ctx: steps.append(int(ctx.input_ids.numel())))
    rng = np.random.default_rng(6)
    req = ScoreRequest("long", rng.integers(0, VOCAB, n), 100, rng.choice(VOCAB, 8, replace=False), max_tokens=1)
    check(path, [req], eng.run_to_completion([req]))
    assert len(steps) >= n // 40 and max(steps) <= 40, (len(steps), max(steps))


# --- prefix reuse ------------------------------------------------------------------------------


@pytest.mark.parametrize("family,prompt_len", [("qwen3_5", 45), ("qwen3_5", 48), ("qwen3_5", 49),
                                               ("qwen3_5_moe", 45)])
def test_group_siblings_start_from_the_prompt_state(family: str, prompt_len: int, checkpoints) -> None:
    """A GRPO group: the first response computes the prompt (in several chunks at a 16-token
    budget) and saves the state at the reuse boundary; its siblings start from it. Their
    results equal the engine's with the cache off and transformers', and the prefix-cache
    counters show every sibling hit the prompt's blocks up to that boundary."""
    path = checkpoints[family]
    reqs = group(np.random.default_rng(prompt_len), prompt_len, 4, 11, per_row=prompt_len % 2 == 1, tag="g")
    cold = engine(path, budget=16, cache=False).run_to_completion(reqs)
    eng = engine(path, budget=16)
    first = eng.run_to_completion(reqs[:1])
    hits_before = eng.stats().prefix_hit_tokens
    rest = eng.run_to_completion(reqs[1:])
    assert first[0].cached_tokens == 0 and all(c.cached_tokens == 0 for c in cold)
    assert [r.cached_tokens for r in rest] == [cache_end(prompt_len)] * 3
    assert eng.stats().prefix_hit_tokens - hits_before == 3 * cache_end(prompt_len)
    assert_same(first + rest, cold)
    check(path, reqs, first + rest)


def test_groups_arriving_together(checkpoints) -> None:
    """Three groups submitted at once, longer prompts (several chunks each): one member computes
    each prompt while its siblings wait for the snapshot, then reuse it."""
    path = checkpoints["qwen3_5"]
    rng = np.random.default_rng(0)
    reqs = [r for g in range(3) for r in group(rng, 60, 4, 9, per_row=g == 1, tag=f"t{g}")]
    cold = engine(path, budget=64, cache=False).run_to_completion(reqs)
    warm = engine(path, budget=64).run_to_completion(reqs)
    assert_same(warm, cold)
    assert sorted(w.cached_tokens for w in warm) == [0] * 3 + [cache_end(60)] * 9


def test_cache_salt_isolates(checkpoints) -> None:
    """The same sequence under salts a, b, a and none: only the second a reuses a's state."""
    path = checkpoints["qwen3_5"]
    (base,) = group(np.random.default_rng(1), 41, 1, 10, per_row=False, tag="s")
    eng = engine(path)

    def run(rid: str, salt: str | None):
        return eng.run_to_completion([ScoreRequest(rid, base.token_ids, base.start, base.candidates,
                                                   cache_salt=salt, max_tokens=1)])[0]

    a, b, c, d = run("a", "tenant-a"), run("b", "tenant-b"), run("c", "tenant-a"), run("d", None)
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens, d.cached_tokens) == (0, 0, cache_end(41), 0)
    assert_same([b, c, d], [a, a, a])
    check(path, [base], [c])


def test_eviction_under_a_small_state_and_kv_budget(checkpoints) -> None:
    """Six groups with long, chunked members through a pool of 40 blocks and 4 state slots,
    twice: snapshots and blocks are evicted and slots reused while other sequences run; every
    result equals the engine's without the cache, and nothing is left held at the end."""
    path = checkpoints["qwen3_5"]
    rng = np.random.default_rng(2)
    reqs = []
    for g in range(6):
        reqs += group(rng, int(rng.integers(20, 100)), 3, int(rng.integers(5, 120)), per_row=g % 2 == 1, tag=f"e{g}")
    cold = engine(path, budget=48, cache=False, blocks=40, linear_state_slots=4).run_to_completion(reqs)
    check(path, reqs[::4], cold[::4])
    eng = engine(path, budget=48, blocks=40, linear_state_slots=4)
    for p in range(2):  # the second pass hits what the first left, and evicts more
        assert_same(eng.run_to_completion(again(reqs, f"-{p}")), cold)
    stats = eng.stats()
    assert stats.kv_blocks_used == 0 and stats.active_requests == 0
    assert stats.prefix_hit_tokens > 0


def test_deterministic_mode(checkpoints) -> None:
    """Deterministic mode: the same request gives the same bits alone and in a batch (chunked
    either way), and matches transformers."""
    path = checkpoints["qwen3_5"]
    cfg = Config(model=str(path), device="cpu", deterministic=True, max_num_batched_tokens=48, num_kv_blocks=256,
                 block_size=BS, max_model_len=512)
    reqs = make_requests(np.random.default_rng(9))
    batch = Engine(cfg).run_to_completion(reqs)
    check(path, reqs, batch)
    eng = Engine(cfg)
    for q, r in zip(reqs, batch):
        (alone,) = eng.run_to_completion(again([q], "a"))
        np.testing.assert_array_equal(alone.token_id_logprobs, r.token_id_logprobs)



def test_served_over_http(checkpoints) -> None:
    """The server with a Qwen3.5 checkpoint: a GRPO pair posted one after the other (binary
    per-row candidates, a salt) scores as transformers does, the second reports the prompt's
    blocks as cached, and /metrics shows the state slots and the snapshot held."""
    from apiutil import body, decode, npy_b64
    from conftest import LiveServer

    path = checkpoints["qwen3_5_moe"]
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=BS, num_kv_blocks=256,
                 max_model_len=1024, max_logprobs=64)
    reqs = group(np.random.default_rng(12), 70, 2, 20, per_row=True, tag="h", salt="tenant")
    with LiveServer(cfg) as srv, srv.client() as c:
        outs = []
        for q in reqs:
            payload = body(q.token_ids, npy_b64(q.candidates.astype(np.int32)), start=q.start, max_tokens=1)
            r = c.post("/inference/v1/generate", json={**payload, "cache_salt": q.cache_salt})
            assert r.status_code == 200, r.text
            outs.append(r.json())
        metrics = c.get("/metrics").text
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == [0, cache_end(70)]
    for q, o in zip(reqs, outs):
        ref = reference_scores(path, q.token_ids.tolist(), q.candidates, q.start)
        np.testing.assert_allclose(decode(o["prompt_token_id_logprobs"]), ref, atol=TOL, rtol=0)
    snapshots = [line for line in metrics.splitlines() if line.startswith("teacher_server_linear_state_snapshots")]
    assert snapshots and float(snapshots[0].rsplit(" ", 1)[1]) >= 1, snapshots


def test_all_full_attention_layers(tmp_path) -> None:
    """A Qwen3.5 config whose layers are all full attention keeps no linear state (and starts)."""
    import transformers as tf

    cfg = tf.Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               layer_types=["full_attention"] * 2, max_position_embeddings=4096)
    torch.manual_seed(0)
    tf.Qwen3_5ForCausalLM(cfg).float().save_pretrained(tmp_path / "m", safe_serialization=True)
    eng = engine(tmp_path / "m")
    assert eng.stats().state_slots_total == 0
    reqs = make_requests(np.random.default_rng(1))
    check(tmp_path / "m", reqs, eng.run_to_completion(reqs))


def test_an_odd_rotary_width_rotates_as_transformers_does(tmp_path) -> None:
    """head_dim 20 x partial_rotary_factor 0.25 = 5 rotary dims: transformers takes 3 frequencies
    and rotates 6 dims; the engine scores the same matrix."""
    import transformers as tf

    cfg = tf.Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=20,
                               layer_types=["linear_attention", "full_attention"], max_position_embeddings=4096,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=8,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    tf.Qwen3_5ForCausalLM(cfg).float().save_pretrained(tmp_path / "m", safe_serialization=True)
    assert ModelSpec.from_dir(tmp_path / "m").rotary_dim == 5
    reqs = make_requests(np.random.default_rng(2))
    check(tmp_path / "m", reqs, engine(tmp_path / "m").run_to_completion(reqs))


def test_a_model_without_a_full_attention_layer_is_refused_by_name() -> None:
    """layer_types all linear attention: refused at start-up (the engine's memory plan keeps KV
    for some layer), not failing later in the planner or the warm-up."""
    from teacher_server.models.spec import UnsupportedModelError

    d = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}
    ModelSpec.from_dict({**d, "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(UnsupportedModelError, match="no full_attention layer"):
        ModelSpec.from_dict({**d, "layer_types": ["linear_attention"] * 2})
    # ungated full-attention layers (vLLM reads the flag; transformers gates whatever it says): by name,
    # not a q_proj shape mismatch at load, nor gated weights served under an ungated FLOP count
    mixed = {**d, "layer_types": ["linear_attention", "full_attention"]}
    assert ModelSpec.from_dict({**mixed, "attn_output_gate": True}).attn_output_gate
    with pytest.raises(UnsupportedModelError, match="attn_output_gate=false"):
        ModelSpec.from_dict({**mixed, "attn_output_gate": False})


def test_gated_attention_stages_compiled_match_their_definitions_and_a_wrong_one_is_caught() -> None:
    """Qwen3.5's gated attention stages through torch.compile (as ``FusedOps`` compiles them)
    pass the start-up check at the 9B's heads (q 16 x 256 with its gate, k/v 4 x 256, rotary on
    the first 64 dims), writing into buffers with slack rows; a stage that rotates the whole
    head fails it, and so does an output gate without the sigmoid."""
    from teacher_server.ops.partial_rope import check_gated_stages, gated_qk_prep, rotate_part, sigmoid_gate
    from teacher_server.ops.qkv_rope import HeadLayout

    torch.manual_seed(0)
    table = torch.cat([torch.cos(torch.arange(64.0)[:, None] * torch.rand(32)),
                       torch.sin(torch.arange(64.0)[:, None] * torch.rand(32))], dim=1)  # [positions, 64]
    heads = HeadLayout(16, 4, 256, 1e-6)
    qn, kn = (1 + 0.1 * torch.randn(256, dtype=torch.bfloat16) for _ in range(2))
    args = (heads, qn, kn, table, torch.device("cpu"), torch.bfloat16)
    prep, gate = (torch.compile(f, fullgraph=True) for f in (gated_qk_prep, sigmoid_gate))
    check_gated_stages(prep, gate, *args)

    def whole_head(qkv, cs, q_norm, k_norm, n_q, n_kv, d, eps, q_out, k_out, v_out):
        wide = torch.cat([cs[:, :32], torch.ones(cs.shape[0], d // 2 - 32), cs[:, 32:],
                          torch.zeros(cs.shape[0], d // 2 - 32)], dim=1)
        g = gated_qk_prep(qkv, cs, q_norm, k_norm, n_q, n_kv, d, eps, q_out, k_out, v_out)
        q_out.copy_(rotate_part(q_out, wide))
        return g

    with pytest.raises(RuntimeError, match="gated_qk_prep q"):
        check_gated_stages(whole_head, sigmoid_gate, *args)
    with pytest.raises(RuntimeError, match="sigmoid_gate"):
        check_gated_stages(gated_qk_prep, lambda o, g: (o * g).reshape(o.shape[0], -1), *args)
