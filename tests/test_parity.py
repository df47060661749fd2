"""The engine's matrix equals transformers' float32 log_softmax gathered at the same ids,
for every supported family, both candidate forms, edge starts, and chunked sequences."""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from reference import FAMILIES, errors_vs_reference, hf_model, reference_logprobs, reference_scores

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

VOCAB = 512
TOL = 1e-4  # float32 engine vs float32 transformers; the contract bound is 1e-3


def make_requests(rng: np.random.Generator, k: int = 6) -> list[ScoreRequest]:
    """Flat and per-row candidates, start in {0, len-2, len-1, beyond the end, inside},
    lengths from 1 to long enough to be chunked several times at a 32-token budget."""
    reqs = []
    specs = [(1, 0), (2, 0), (7, 5), (7, 6), (7, 10), (40, 0), (40, 38), (150, 17), (150, 0), (97, 64), (130, 129)]
    for j, (n, start) in enumerate(specs):
        toks = rng.integers(0, VOCAB, n)
        rows = max(n - 1 - start, 0)
        if j % 2:
            cand = np.stack([rng.choice(VOCAB, k, replace=False) for _ in range(rows)]) if rows else np.zeros((0, k), np.int64)
            if rows:
                cand[rng.random((rows, k)) < 0.2] = -1
        else:
            cand = rng.choice(VOCAB, k, replace=False)
        reqs.append(ScoreRequest(f"r{j}", toks, start, cand, max_tokens=1))
    return reqs


def check(path, reqs, results, tol: float = TOL, logits_mode: bool = False) -> float:
    worst = 0.0
    for q, r in zip(reqs, results):
        assert r.error is None, r.error
        ref = reference_scores(path, q.token_ids.tolist(), q.candidates, q.start, logits_mode)
        got = r.token_id_logprobs
        assert got.shape == (q.rows, q.k) and got.dtype == np.float32
        fin = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(got), fin)
        assert (got[~fin] == -np.inf).all()
        if fin.any():
            worst = max(worst, float(np.abs(got[fin] - ref[fin]).max()))
        # greedy next token = argmax of the last row of the reference
        last = reference_logprobs(path, q.token_ids.tolist())[-1]
        assert last[r.next_token] >= last.max() - 1e-5
    assert worst < tol, worst
    return worst


def family_rng(family: str) -> np.random.Generator:
    """The same request data for a family in every run (Python's ``hash`` of a str is salted)."""
    return np.random.default_rng(zlib.crc32(family.encode()) % 1000)


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_cpu(family: str, checkpoints) -> None:
    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8,
                        num_kv_blocks=256, max_model_len=512))
    reqs = make_requests(family_rng(family))
    check(path, reqs, eng.run_to_completion(reqs))


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_parity_cpu_residual_add_in_gemm(family: str, checkpoints) -> None:
    """The residual add done inside the o/down projection (in place, the CUDA default) gives
    the same results as the separate add."""
    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8,
                        num_kv_blocks=256, max_model_len=512))
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    reqs = make_requests(np.random.default_rng(11))
    check(path, reqs, eng.run_to_completion(reqs))


def test_sliding_window_mistral(tmp_path) -> None:
    """Mistral with a sliding window shorter than the sequence, across chunk boundaries."""
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                           max_position_embeddings=512)
    torch.manual_seed(0)
    tf.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    model = hf_model(tmp_path)
    model.config._attn_implementation = "sdpa"
    eng = Engine(Config(model=str(tmp_path), device="cpu", max_num_batched_tokens=32, block_size=8,
                        num_kv_blocks=256, max_model_len=512))
    reqs = make_requests(np.random.default_rng(5))
    check(tmp_path, reqs, eng.run_to_completion(reqs))


def test_logits_mode(checkpoints) -> None:
    path = checkpoints["qwen3"]
    eng = Engine(Config(model=str(path), device="cpu", logprobs_mode="raw_logits", max_num_batched_tokens=64,
                        num_kv_blocks=128, block_size=8, max_model_len=512))
    reqs = make_requests(np.random.default_rng(1))
    check(path, reqs, eng.run_to_completion(reqs), logits_mode=True)


def test_prompt_logprobs_and_candidates_agree(checkpoints) -> None:
    path = checkpoints["llama"]
    eng = Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=16, num_kv_blocks=128,
                        block_size=8, max_model_len=512))
    rng = np.random.default_rng(3)
    toks = rng.integers(0, VOCAB, 60)
    start = 20
    cand = np.stack([[toks[start + i + 1]] for i in range(60 - 1 - start)])  # K=1: the actual tokens
    req = ScoreRequest("p", toks, start, cand, prompt_logprobs=5, max_tokens=0)
    (res,) = eng.run_to_completion([req])
    ref = reference_logprobs(path, toks.tolist())  # [L, V]
    actual = ref[np.arange(59), toks[1:]]
    np.testing.assert_allclose(res.plp_token_logprob, actual, atol=TOL)
    # the candidate matrix and prompt_logprobs come from the same logits and must agree
    np.testing.assert_allclose(res.token_id_logprobs[:, 0], res.plp_token_logprob[start:], atol=1e-6)
    ranks = (ref[np.arange(59)] > actual[:, None]).sum(-1) + 1
    np.testing.assert_array_equal(res.plp_token_rank, ranks)
    top = np.argsort(-ref[:59], axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(res.plp_topk_ids, top)
    np.testing.assert_allclose(res.plp_topk_logprobs, np.take_along_axis(ref[:59], top, -1), atol=TOL)
    assert res.next_token is None


def test_batch_composition_does_not_change_results(checkpoints) -> None:
    """Deterministic mode: the same request gives the same bits alone and in a batch."""
    path = checkpoints["qwen2"]
    cfg = Config(model=str(path), device="cpu", deterministic=True, max_num_batched_tokens=48,
                 num_kv_blocks=256, block_size=8, max_model_len=512)
    reqs = make_requests(np.random.default_rng(9))
    batch = Engine(cfg).run_to_completion(reqs)
    eng = Engine(cfg)
    for q, r in zip(reqs, batch):
        alone = eng.run_to_completion([ScoreRequest(q.request_id + "a", q.token_ids, q.start, q.candidates,
                                                 max_tokens=q.max_tokens)])[0]
        np.testing.assert_array_equal(alone.token_id_logprobs, r.token_id_logprobs)


# --- the same on the GPU -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_gpu_float32(family: str, checkpoints) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cuda", dtype="float32", max_num_batched_tokens=32,
                        block_size=8, num_kv_blocks=256, max_model_len=512))
    reqs = make_requests(np.random.default_rng(7))
    check(path, reqs, eng.run_to_completion(reqs), tol=1e-3)


def long_requests(rng: np.random.Generator, k: int = 16) -> list[ScoreRequest]:
    """Sequences long enough for the cuDNN paths (>= 256 queries): fresh ones of equal and
    unequal lengths, and ones chunked at a 512-token budget (prefixed continuations)."""
    specs = [(700, 300), (1200, 100), (512, 0), (512, 400), (300, 299), (90, 10)]
    reqs = []
    for j, (n, start) in enumerate(specs):
        reqs.append(ScoreRequest(f"L{j}", rng.integers(0, VOCAB, n), start, rng.choice(VOCAB, k, replace=False),
                                 max_tokens=1))
    return reqs


@pytest.mark.gpu
@pytest.mark.parametrize("family,shape", [("qwen3", "short"), ("llama", "short"), ("qwen2", "short"),
                                          ("qwen3hd128", "short"), ("qwen3hd128", "long")])
def test_parity_gpu_bfloat16(family: str, shape: str, checkpoints) -> None:
    """bf16 weights vs the float32 reference: our mean abs error is no larger than that of
    transformers' own bf16 forward on the same weights (bf16 rounding of weights and
    activations is the floor; our fp32 logits + fp32 log-softmax must not add to it, and
    avoid transformers' bf16 rounding of the logits). ``long`` runs the
    cuDNN attention paths (dense fresh sequences, merged prefixed chunks)."""
    path = checkpoints[family]
    budget = 64 if shape == "short" else 512
    eng = Engine(Config(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=budget,
                        block_size=16, num_kv_blocks=512, max_model_len=2048))
    reqs = make_requests(np.random.default_rng(11)) if shape == "short" else long_requests(np.random.default_rng(5))
    results = eng.run_to_completion(reqs)
    # the engine's GPU timeline: every step has a measured span; gaps are never negative
    s = eng.stats()
    assert s.timing.gpu_s > 0 and s.timing.gpu_idle_s >= 0 and s.steps > 1
    import transformers as tf

    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    ours_mae, theirs_mae = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    print(f"{family}/{shape} ({eng.attn.name} attention): bf16 mean abs error vs fp32 reference: "
          f"ours {ours_mae:.5f}, transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae, (ours_mae, theirs_mae)


@pytest.mark.gpu
def test_gpu_deterministic_batch_composition_does_not_change_results(checkpoints) -> None:
    """Deterministic mode on the GPU (bf16, the cuDNN paths and, on Hopper, the fused gate/up
    kernel: this model's widths are multiples of 128): the same request gives the same bits
    alone, in a batch, and again."""
    path = checkpoints["qwen3hd128"]
    cfg = Config(model=str(path), device="cuda", dtype="bfloat16", deterministic=True, max_num_batched_tokens=512,
                 block_size=16, num_kv_blocks=512, max_model_len=2048)
    reqs = long_requests(np.random.default_rng(17))
    batch = Engine(cfg).run_to_completion(reqs)
    eng = Engine(cfg)
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper: the fused gate/up kernel is what runs
        assert eng.runner.ops.gate_up_kernel
    for q, r in zip(reqs, batch):
        for n in range(2):
            alone = eng.run_to_completion([ScoreRequest(f"{q.request_id}a{n}", q.token_ids, q.start, q.candidates,
                                                     max_tokens=q.max_tokens)])[0]
            np.testing.assert_array_equal(alone.token_id_logprobs, r.token_id_logprobs)


@pytest.mark.gpu
def test_gpu_pipelined_delivery_equals_sequential(checkpoints) -> None:
    """On the GPU (real events: the launch pacer, its first-wait hook, idle gaps), the
    pipelined engine hands each result over exactly once, early through ``deliver`` or
    returned, equal to the sequential engine's; long requests make several paced steps with
    cuDNN prefixed chunks, and the one-new-plan-per-step limit sends some to varlen."""
    path = checkpoints["qwen3hd128"]
    cfg = dict(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=512, block_size=16,
               num_kv_blocks=512, max_model_len=2048)
    reqs = long_requests(np.random.default_rng(21))
    seq = {r.request_id: r for r in Engine(Config(**cfg, pipeline=False)).run_to_completion(reqs)}
    eng = Engine(Config(**cfg, pipeline=True))
    eng.tuning = replace(eng.tuning, run_ahead=1)  # the test model has 2 layers: make the launch wait (and hand off)
    for q in reqs:
        eng.add_request(q)
    got: dict[str, list] = {}

    def take(rs) -> None:
        for r in rs:
            got.setdefault(r.request_id, []).append(r)

    early = 0
    while eng.has_unfinished():
        before = sum(map(len, got.values()))
        returned = eng.step(deliver=take)
        early += sum(map(len, got.values())) - before
        take(returned)
    assert eng.stats().steps > 3 and early > 0
    assert sorted(got) == sorted(seq) and all(len(v) == 1 for v in got.values())
    for rid, (r,) in got.items():
        assert r.error is None
        np.testing.assert_allclose(r.token_id_logprobs, seq[rid].token_id_logprobs, atol=2e-2)
    t = eng.stats().timing
    assert t.gpu_s > 0 and t.gpu_idle_s >= 0 and t.launch_s >= 0 and t.wait_s > 0
