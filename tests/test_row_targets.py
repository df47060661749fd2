"""The row targets (the teacher's top-K, the union with the candidates, the actual token's
log-prob, the log of the mass outside the returned columns, the log normalizer, a
temperature before the softmax) equal transformers' float32 forward, computed in float64,
with chunked sequences and prefix-cache hits, in deterministic mode, and at TP2 (gloo) as at
TP1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reference import hf_model, torch_reference_kernels

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.targets import union_columns

TOL = 1e-4


@torch.no_grad()
def reference_logits(path: Path, toks: np.ndarray) -> np.ndarray:
    """[L, V] float64 logits of the float32 transformers forward."""
    with torch_reference_kernels():
        return hf_model(path)(torch.tensor([toks.tolist()])).logits[0].double().numpy()


def expected(path: Path, req: ScoreRequest, logits_mode: bool = False) -> dict[str, np.ndarray]:
    """What the contract says each asked target holds, from the float64 reference."""
    x = reference_logits(path, req.token_ids)[req.start:req.length - 1] / req.temperature  # [rows, V]
    lse = np.logaddexp.reduce(x, axis=1)
    lp = x if logits_mode else x - lse[:, None]
    rows = np.arange(x.shape[0])
    out: dict[str, np.ndarray] = {"logsumexp": lse, "actual": lp[rows, req.token_ids[req.start + 1:]]}
    top = np.argsort(-lp, axis=1, kind="stable")[:, :req.top_k]
    out["topk_ids"], out["topk_lp"] = top, np.take_along_axis(lp, top, 1)
    inside = np.zeros(lp.shape, dtype=bool)
    if req.top_k:
        np.put_along_axis(inside, top, True, 1)
    if req.candidates is not None:
        c = np.broadcast_to(req.candidates, (len(rows), req.k)) if req.candidates.ndim == 1 else req.candidates
        out["scores"] = np.where(c >= 0, np.take_along_axis(lp, np.maximum(c, 0), 1), -np.inf)
        for i, j in zip(*np.nonzero(c >= 0)):
            inside[i, c[i, j]] = True
    out["tail"] = np.array([np.logaddexp.reduce(lp[i][~inside[i]]) if (~inside[i]).any() else -np.inf
                            for i in rows])
    return out


def assert_targets(path: Path, req: ScoreRequest, res: ScoreResult, logits_mode: bool = False,
                   tol: float = 1e-4) -> None:
    assert res.error is None, res.error
    e = expected(path, req, logits_mode)
    if req.top_k:
        np.testing.assert_array_equal(res.topk_ids, e["topk_ids"])
        np.testing.assert_allclose(res.topk_logprobs, e["topk_lp"], atol=tol, rtol=0)
    if req.actual:
        np.testing.assert_allclose(res.actual_logprobs, e["actual"], atol=tol, rtol=0)
    if req.logsumexp:
        np.testing.assert_allclose(res.logsumexp, e["logsumexp"], atol=tol, rtol=1e-6)
    if req.tail:
        np.testing.assert_allclose(res.tail_logprobs, e["tail"], atol=tol, rtol=0)
    if req.candidates is not None:
        fin = np.isfinite(e["scores"])
        np.testing.assert_array_equal(np.isfinite(res.token_id_logprobs), fin)
        np.testing.assert_allclose(res.token_id_logprobs[fin], e["scores"][fin], atol=tol, rtol=0)


def make_requests(vocab: int, seed: int = 0) -> list[ScoreRequest]:
    """Every target alone and together, with and without candidates and temperatures; a prompt
    shared by three responses (prefix-cache hits on the second wave); sequences longer than a
    step (chunked)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 40)
    cand = rng.integers(0, vocab, (39, 6))
    cand[rng.random(cand.shape) < 0.2] = -1
    out = [
        ScoreRequest("all", rng.integers(0, vocab, 60), 20, cand, max_tokens=1, top_k=8, union=True, actual=True,
                     tail=True, logsumexp=True),
        ScoreRequest("hot", rng.integers(0, vocab, 50), 5, None, top_k=5, actual=True, tail=True, temperature=0.7),
        ScoreRequest("cold", rng.integers(0, vocab, 30), 0, np.array([1, 2, 3]), prompt_logprobs=3, top_k=2,
                     logsumexp=True, tail=True, temperature=1.5),
        ScoreRequest("act", rng.integers(0, vocab, 9), 3, None, actual=True),
    ]
    for j in range(3):
        toks = np.concatenate([prompt, rng.integers(0, vocab, 25)])
        out.append(ScoreRequest(f"g{j}", toks, 39, rng.integers(0, vocab, (25, 4)), top_k=4, actual=True,
                                tail=True, temperature=0.9 if j else 1.0))
    return out


def run(path: Path, tp: int = 1, **settings: object) -> tuple[list[ScoreRequest], list[ScoreResult], int]:
    settings = {"device": "cpu", **settings}
    cfg = Config(model=str(path), max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                 max_model_len=512, tensor_parallel_size=tp, **settings)
    eng = Engine(cfg)
    try:
        reqs = make_requests(eng.spec.vocab_size)
        res = eng.run_to_completion(reqs[:5]) + eng.run_to_completion(reqs[5:])
        return reqs, res, eng.stats().prefix_hit_tokens
    finally:
        eng.close()


def test_targets_equal_the_float32_reference(checkpoints) -> None:
    path = checkpoints["qwen3"]
    reqs, results, hits = run(path)
    assert hits > 0  # the second wave read the shared prompt from the cache
    for req, res in zip(reqs, results):
        assert_targets(path, req, res)
    # the classic prompt_logprobs of a request with a temperature come from the same processed logits
    cold, res = reqs[2], results[2]
    lp = expected(path, cold)
    np.testing.assert_allclose(res.plp_token_logprob, lp["actual"], atol=TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("logits_mode", [False, True])
def test_targets_on_cuda_equal_the_reference(checkpoints, logits_mode: bool) -> None:
    """The CUDA path (the gather kernel's one-pass normalizer, the in-place tail mask on a view of
    the chunk) in float32, within the GPU parity tests' bound."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = checkpoints["qwen3"]
    reqs, results, _ = run(path, device="cuda", dtype="float32",
                           **({"logprobs_mode": "raw_logits"} if logits_mode else {}))
    for req, res in zip(reqs, results):
        assert_targets(path, req, res, logits_mode=logits_mode, tol=1e-3)


def test_targets_in_raw_logits_mode(checkpoints) -> None:
    path = checkpoints["llama"]
    reqs, results, _ = run(path, logprobs_mode="raw_logits")
    for req, res in zip(reqs, results):
        assert_targets(path, req, res, logits_mode=True)


def test_deterministic_mode_same_bits_alone_and_batched(checkpoints) -> None:
    path = checkpoints["qwen2"]
    cfg = Config(model=str(path), device="cpu", deterministic=True, max_num_batched_tokens=32, num_kv_blocks=128,
                 block_size=8, max_model_len=512)
    eng = Engine(cfg)
    reqs = make_requests(eng.spec.vocab_size, seed=1)
    batched = eng.run_to_completion(reqs)
    alone = eng.run_to_completion([reqs[0]])[0]
    for name in ("topk_ids", "topk_logprobs", "actual_logprobs", "tail_logprobs", "logsumexp", "token_id_logprobs"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(batched[0], name))
    assert_targets(path, reqs[0], alone)


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    """Each rank's top-K over its vocab shard merged, the masked sums and the normalizer
    all-reduced: TP2 gives TP1's targets on an odd vocab (uneven shards)."""
    from test_tensor_parallel import tiny_checkpoint

    path = tiny_checkpoint(tmp_path / "odd", "qwen2", 301, 4, 1)
    _, one, _ = run(path, 1)
    reqs, two, _ = run(path, 2)
    for req, a, b in zip(reqs, one, two):
        assert b.error is None, b.error
        for name in ("topk_ids", "topk_logprobs", "actual_logprobs", "tail_logprobs", "logsumexp",
                     "token_id_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                np.testing.assert_allclose(y, x, atol=1e-5, rtol=0, err_msg=f"{req.request_id} {name}")
    assert_targets(path, reqs[0], two[0])


def test_union_columns() -> None:
    cand = np.array([[5, -1, 7], [1, 2, 3]])
    scores = np.array([[-1.0, -np.inf, -2.0], [-3.0, -4.0, -5.0]], dtype=np.float32)
    top = np.array([[7, 9, 5], [4, 3, 6]])
    top_lp = np.array([[-2.0, -2.5, -1.0], [-0.5, -5.0, -6.0]], dtype=np.float32)
    ids, lps = union_columns(cand, scores, top, top_lp)
    np.testing.assert_array_equal(ids, [[5, -1, 7, 9, -1, -1], [1, 2, 3, 4, 6, -1]])
    np.testing.assert_array_equal(lps, [[-1, -np.inf, -2, -2.5, -np.inf, -np.inf], [-3, -4, -5, -0.5, -6, -np.inf]])
    ids, _ = union_columns(np.array([9, 4]), scores[:, :2], top, top_lp)  # shared candidates
    np.testing.assert_array_equal(ids, [[9, 4, 7, 5, -1], [9, 4, 3, 6, -1]])
    assert union_columns(np.array([1]), np.zeros((0, 1), np.float32), np.zeros((0, 2), np.int64),
                         np.zeros((0, 2), np.float32))[0].shape == (0, 3)


@pytest.mark.parametrize(("kw", "param"), [
    ({"topk": 0}, "prompt_logprob_topk"),
    ({"topk": 100000}, "prompt_logprob_topk"),
    ({"union": True, "topk": 2}, "prompt_logprob_union"),
    ({"tail": True}, "prompt_logprob_tail"),
    ({"temperature": 0.0, "actual": True}, "prompt_logprob_temperature"),
    ({"temperature": float("nan"), "actual": True}, "prompt_logprob_temperature"),
])
def test_bad_targets_are_refused_naming_the_field(kw: dict, param: str) -> None:
    from teacher_server.validation import BadRequest, Limits, RowTargets, build_request

    limits = Limits(vocab_size=512, max_model_len=128, max_logprobs=256, max_rows_x_k=10000)
    with pytest.raises(BadRequest) as e:
        build_request(token_ids=[1, 2, 3], limits=limits, targets=RowTargets(**kw))
    assert e.value.param == "sampling_params." + param and e.value.status == 400


def test_http_and_clients_return_the_targets(qwen3_server, checkpoints) -> None:
    """The endpoint's options, the response's base64 arrays (ids int32, values float32), the
    sync and async clients' numpy arrays and the in-process LLM: the same values, equal to the
    reference."""
    import asyncio

    from apiutil import assert_error, body, decode

    from teacher_server.client import AsyncTeacherClient, Targets, TeacherClient
    from teacher_server.llm import LLM, SamplingParams

    path = checkpoints["qwen3"]
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 512, 40)
    cand = rng.integers(0, 512, (30, 3))
    req = ScoreRequest("h", toks, 9, cand, top_k=7, union=True, actual=True, tail=True, logsumexp=True,
                       temperature=0.8)
    sp = {"prompt_logprob_topk": 7, "prompt_logprob_union": True, "prompt_logprob_actual": True,
          "prompt_logprob_tail": True, "prompt_logprob_logsumexp": True, "prompt_logprob_temperature": 0.8}
    with qwen3_server.client() as http:
        r = http.post("/inference/v1/generate", json=body(toks, cand, 9, max_tokens=0, **sp))
        assert r.status_code == 200, r.text
        data = r.json()
        assert_error(http.post("/inference/v1/generate", json=body(toks, None, 9, prompt_logprob_union=True,
                                                                   prompt_logprob_topk=3)),
                     400, "sampling_params.prompt_logprob_union")
        assert_error(http.post("/inference/v1/generate", json=body(toks, None, 9, prompt_logprob_topk=65)),
                     400, "sampling_params.prompt_logprob_topk")
    ids = decode(data["prompt_topk_token_ids"])
    assert ids.dtype == np.int32 and ids.shape == (30, 7)
    assert decode(data["prompt_union_token_ids"]).dtype == np.int32
    res = ScoreResult("h", 0, 40, token_id_logprobs=decode(data["prompt_token_id_logprobs"]), topk_ids=ids,
                      topk_logprobs=decode(data["prompt_topk_logprobs"]),
                      actual_logprobs=decode(data["prompt_actual_logprobs"]),
                      tail_logprobs=decode(data["prompt_tail_logprobs"]), logsumexp=decode(data["prompt_logsumexp"]))
    assert_targets(path, req, res)
    u_ids, u_lp = union_columns(cand, res.token_id_logprobs, ids, res.topk_logprobs)
    np.testing.assert_array_equal(decode(data["prompt_union_token_ids"]), u_ids)
    np.testing.assert_array_equal(decode(data["prompt_union_logprobs"]), u_lp)

    targets = Targets(topk=7, union=True, actual=True, tail=True, logsumexp=True, temperature=0.8)
    with TeacherClient(qwen3_server.url) as client:
        out = client.score_full(toks, cand, 9, targets=targets)
        only = client.score_full(toks, None, 9, targets=Targets(topk=7, temperature=0.8))

    async def via_async():
        async with AsyncTeacherClient(qwen3_server.url) as ac:
            return await ac.score_full(toks, cand, 9, targets=targets)

    aout = asyncio.run(via_async())
    llm = LLM(str(path), device="cpu", max_model_len=256, num_kv_blocks=64)
    (lout,) = llm.generate({"prompt_token_ids": toks.tolist()},
                           SamplingParams(max_tokens=0, prompt_logprob_token_ids=cand, prompt_logprob_start=9,
                                          **{k: v for k, v in sp.items()}))
    for o in (out, aout):
        np.testing.assert_array_equal(o.topk_ids, ids)
        np.testing.assert_array_equal(o.union_ids, u_ids)
        np.testing.assert_array_equal(o.union_logprobs, u_lp)
        for name, key in (("topk_logprobs", "prompt_topk_logprobs"), ("actual_logprobs", "prompt_actual_logprobs"),
                          ("tail_logprobs", "prompt_tail_logprobs"), ("logsumexp", "prompt_logsumexp")):
            np.testing.assert_array_equal(getattr(o, name), decode(data[key]))
    assert only.scores is None and only.actual_logprobs is None
    np.testing.assert_array_equal(only.topk_ids, ids)
    np.testing.assert_array_equal(lout.prompt_topk_token_ids, ids)
    np.testing.assert_allclose(lout.prompt_tail_logprobs, res.tail_logprobs, atol=1e-5)
    np.testing.assert_array_equal(lout.prompt_union_token_ids, u_ids)


def test_processed_logprobs_mode_applies_the_sampling_temperature(checkpoints) -> None:
    """``--logprobs-mode processed_logprobs``: a request's sampling temperature divides its
    logits (vLLM's mode); 0 (greedy) leaves them; ``prompt_logprob_temperature`` wins over it."""
    from teacher_server.llm import LLM, SamplingParams

    path = checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu", max_model_len=256, num_kv_blocks=64, logprobs_mode="processed_logprobs")
    toks = np.random.default_rng(7).integers(0, 512, 30)
    for sampling, field, want in ((0.5, None, 0.5), (0.0, None, 1.0), (0.5, 2.0, 2.0)):
        (out,) = llm.generate({"prompt_token_ids": toks.tolist()},
                              SamplingParams(max_tokens=0, temperature=sampling, prompt_logprob_topk=4,
                                             prompt_logprob_start=10, prompt_logprob_actual=True,
                                             prompt_logprob_temperature=field))
        req = ScoreRequest("p", toks, 10, None, top_k=4, actual=True, temperature=want)
        res = ScoreResult("p", 0, 30, topk_ids=out.prompt_topk_token_ids, topk_logprobs=out.prompt_topk_logprobs,
                          actual_logprobs=out.prompt_actual_logprobs)
        assert_targets(path, req, res)


@pytest.mark.parametrize(("given", "used"), [(1e-5, 1e-5), (2e-5, 2e-5), (9.9e-6, 1.0), (0.0, 1.0), (None, 1.0)])
def test_processed_logprobs_take_the_sampling_temperature_from_vllms_greedy_threshold_on(given, used) -> None:
    """vLLM samples greedily below 1e-5, so 1e-5 itself divides the logits (it had been taken as 1,
    where prompt_logprob_temperature=1e-5 divided them)."""
    from teacher_server.validation import Limits, build_request

    limits = Limits(vocab_size=512, max_model_len=128, max_logprobs=256, max_rows_x_k=10000, processed=True)
    req = build_request(token_ids=[1, 2, 3], limits=limits, candidates=[4], sampling_temperature=given)
    assert req.temperature == used


@pytest.mark.parametrize("t", [1e-39, 1e-6, 0.0, -1.0, float("inf")])
def test_a_temperature_that_would_overflow_is_refused(t) -> None:
    """logits / t past float32's range makes the softmax NaN: below vLLM's greedy threshold
    (1e-5) the temperature is refused, naming the field."""
    from teacher_server.validation import BadRequest, Limits, RowTargets

    limits = Limits(vocab_size=512, max_model_len=128, max_logprobs=256, max_rows_x_k=10000)
    with pytest.raises(BadRequest, match="prompt_logprob_temperature"):
        RowTargets(topk=4, temperature=t).check(8, False, limits)
    RowTargets(topk=4, temperature=1e-5).check(8, False, limits)


@pytest.mark.parametrize("t", [3.5e38, 1e39, "1e39"])
def test_a_temperature_infinite_in_float32_is_refused(t) -> None:
    """A temperature above float32's largest number is infinite where it divides the logits:
    every logit 0, the greedy token and the top-K ids the lowest ids. Refused, naming the field,
    as ``prompt_logprob_temperature`` and as the sampling temperature of processed_logprobs."""
    from teacher_server.validation import FLOAT32_MAX, BadRequest, Limits, RowTargets, build_request

    limits = Limits(vocab_size=512, max_model_len=128, max_logprobs=256, max_rows_x_k=10000, processed=True)
    if not isinstance(t, str):
        with pytest.raises(BadRequest, match="prompt_logprob_temperature must be a number from 1e-5 to"):
            RowTargets(topk=4, temperature=t).check(8, False, limits)
    with pytest.raises(BadRequest, match="temperature must be at most") as e:
        build_request(token_ids=[1, 2, 3], limits=limits, candidates=[4], sampling_temperature=t)
    assert e.value.param == "sampling_params.temperature"
    RowTargets(topk=4, temperature=FLOAT32_MAX).check(8, False, limits)
    assert build_request(token_ids=[1, 2, 3], limits=limits, candidates=[4],
                         sampling_temperature=FLOAT32_MAX).temperature == FLOAT32_MAX


def test_the_greedy_token_is_the_unscaled_logits_argmax_whatever_the_temperature(checkpoints) -> None:
    """The generated token is taken before the temperature divides the logits (docs/trainers.md:
    "the greedy one, whatever temperature"): a temperature the engine holds as infinity had
    made every logit 0 and the token id 0."""
    path = checkpoints["qwen3"]
    eng = Engine(Config(model=str(path), device="cpu", max_model_len=128, num_kv_blocks=32, block_size=16))
    toks = np.random.default_rng(3).integers(0, 512, 20)
    want = int(np.argmax(reference_logits(path, toks)[-1]))
    assert want != 0
    for t in (1.0, 1e30, 1e39):
        (res,) = eng.run_to_completion([ScoreRequest("g", toks, 10, np.array([1, 2]), max_tokens=1, temperature=t)])
        assert res.error is None and res.next_token == want, (t, res.next_token)
