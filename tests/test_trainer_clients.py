"""The trainers' own client code against a live server on CPU, the numbers compared with the
float32 transformers reference:

- the ``openai`` client (3.51.0): ``completions.create`` with token-id prompts, ``echo``,
  ``logprobs`` and vLLM's ``prompt_logprobs`` through ``extra_body``; its typed errors;
- TRL (1.16.0) async distillation: ``_AsyncRolloutLoop._resolve_teacher_model_names`` and
  ``_score_with_teacher`` (trl/experimental/async_distillation/async_rollout_worker.py), the
  code that asks a vLLM teacher for ``prompt_logprobs`` over ``/v1/completions`` and parses them
  with ``_parse_teacher_logprobs_at_position``, called as the rollout loop calls them;
- ms-swift (4.2.3) GKD with ``--teacher_model_server``: ``fetch_teacher_logprobs``
  (swift/rlhf_trainers/gkd_trainer.py), which looks the model up on ``/v1/models``, asks
  ``/v1/completions`` for ``prompt_logprobs: topk`` per sequence and returns padded top-k tensors,
  called as ``GKDTrainer._fetch_teacher_logprobs_from_api`` calls it (tests/swift_gkd.py says
  how it is loaded)."""

from __future__ import annotations

import asyncio
import queue
import sys
import time

import numpy as np
import pytest
from conftest import LiveServer
from dropin_util import VOCAB, reference_logprobs, with_tokenizer
from swift_gkd import fetch_teacher_logprobs

from teacher_server.config import Config

TOL = 1e-4


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path = with_tokenizer(checkpoints["qwen3"], tmp_path_factory.mktemp("tok") / "qwen3tok")
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=512,
                 max_model_len=1024, max_logprobs=64)
    with LiveServer(cfg) as s:
        s.path = path
        yield s


def test_openai_completions_create(server) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    model = client.models.list().data[0].id
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (24, 41)]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=1, echo=True, logprobs=3, temperature=0.7,
                                    extra_body={"prompt_logprobs": 8, "return_tokens_as_token_ids": True})
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 65
    for toks, ch in zip(prompts, out.choices):
        ref = reference_logprobs(server.path, toks)
        plp = ch.prompt_logprobs  # vLLM's extra field, kept by the client's model
        assert plp[0] is None and len(plp) == len(toks)
        for j in range(1, len(toks)):
            first = next(iter(plp[j]))
            assert first == str(toks[j])
            top = np.argsort(-ref[j - 1], kind="stable")[:8]
            assert set(plp[j]) == {str(t) for t in top} | {str(toks[j])}
            for k, v in plp[j].items():
                assert abs(v["logprob"] - ref[j - 1, int(k)]) < TOL
        lp = ch.logprobs
        assert lp.tokens[0] == f"token_id:{toks[0]}" and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(toks)], ref[np.arange(len(toks) - 1), toks[1:]],
                                   atol=TOL)
        assert abs(lp.token_logprobs[-1] - ref[-1].max()) < TOL and ch.finish_reason == "length"
        assert ch.text == " ".join(f"w{t}" for t in toks + [int(ref[-1].argmax())])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompts[0], max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another", prompt=prompts[0], max_tokens=1)


@pytest.fixture(scope="module")
def processed_server(server):
    """The same checkpoint in ``processed_logprobs`` mode (a request's temperature scales its scores)."""
    cfg = Config(model=str(server.path), device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=512,
                 max_model_len=1024, max_logprobs=64, logprobs_mode="processed_logprobs")
    with LiveServer(cfg) as s:
        s.path = server.path
        yield s


def trl_loop(url: str, k: int, temperature: float = 1.0):
    """TRL's rollout loop with one teacher at ``url``, failing fast: its request timeout (a TRL
    setting) at 30 s, and each call tried once. TRL retries a failed teacher call (any HTTP
    error, a 400 too) 30 times with back-off up to 16 s, 3 tries each: minutes before a test
    against a failing server would end; its attempt counts are not settings, so the loop's own
    ``_retry`` is called with one attempt."""
    if sys.version_info < (3, 11):  # TRL 1.16 needs Python 3.11 (the test extra installs it there only)
        pytest.importorskip("trl", reason="TRL 1.16 needs Python 3.11")
    from accelerate.state import PartialState
    from datasets import Dataset
    from trl.experimental.async_distillation.async_rollout_worker import _AsyncRolloutLoop

    PartialState()  # TRL's rollout child does this before building the loop (accelerate's logger needs it)
    loop = _AsyncRolloutLoop(
        model_name="student", dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}]}]),
        processing_class=None, eos_token_ids=[0], rollout_buffer=queue.Queue(), model_version_value=None,
        heartbeat_value=None, failed_event=None, exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(),
        teacher_server_urls={"default": url}, teacher_top_k=k, teacher_temperature=temperature, request_timeout=30)
    retry = loop._retry
    loop._retry = lambda factory, *, label, max_attempts=1: retry(factory, label=label, max_attempts=1)
    return loop


def trl_score(loop, url: str, prompt_ids: list[int], completion_ids: list[int]):
    """``_resolve_teacher_model_names`` then ``_score_with_teacher``, as the rollout loop calls them."""
    import aiohttp

    async def score():
        async with aiohttp.ClientSession() as session:
            loop.session = session
            await loop._resolve_teacher_model_names()
            name = loop.teacher_model_names["default"]
            return await loop._score_with_teacher(prompt_ids, completion_ids, url, name)

    return asyncio.run(score())


@pytest.mark.timeout(60)  # (a failing server fails the test, it does not wait out TRL's retries)
@pytest.mark.parametrize(("which", "temperature"), [("server", 1.0), ("processed_server", 0.7)])
def test_trl_async_distillation_teacher_scoring(which: str, temperature: float, request) -> None:
    """TRL's teacher call as its rollout loop makes it; ``teacher_temperature`` reaches the scores on a
    server in processed_logprobs mode, as TRL's docs say of vLLM."""
    server = request.getfixturevalue(which)
    k = 6
    loop = trl_loop(server.url, k, temperature)
    rng = np.random.default_rng(1)
    prompt_ids, completion_ids = rng.integers(0, VOCAB, 20).tolist(), rng.integers(0, VOCAB, 50).tolist()
    ids, lps = trl_score(loop, server.url, prompt_ids, completion_ids)
    toks = prompt_ids + completion_ids
    if temperature == 1.0:
        ref = reference_logprobs(server.path, toks)
    else:  # log_softmax(logits / T) from the reference's log-probs (a shift per row leaves the softmax)
        x = reference_logprobs(server.path, toks) / temperature
        ref = x - np.logaddexp.reduce(x, axis=1, keepdims=True)
    assert len(ids) == len(completion_ids)
    for i, (row_ids, row_lps) in enumerate(zip(ids, lps)):
        p = len(prompt_ids) + i  # scores toks[p] given toks[:p]: reference row p - 1
        top = np.argsort(-ref[p - 1], kind="stable")[:k].tolist()
        actual = toks[p]
        want = top if actual in top else top + [actual]  # by rank: the realized token last when outside
        assert row_ids == want
        np.testing.assert_allclose(row_lps, ref[p - 1, want], atol=TOL)


@pytest.mark.timeout(60)
def test_trl_against_a_refusing_server_fails_fast(server) -> None:
    """A teacher that answers 400 (top-K beyond ``max_logprobs``) fails TRL's call at once."""
    import aiohttp

    t0 = time.monotonic()
    with pytest.raises(aiohttp.ClientResponseError) as e:
        trl_score(trl_loop(server.url, 65), server.url, [1, 2, 3], [4, 5])
    assert e.value.status == 400 and time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["server", "processed_server"])
def test_ms_swift_gkd_fetch_teacher_logprobs(which: str, request) -> None:
    """ms-swift's teacher call for a padding-free batch, as its trainer makes it: one id list per
    packed sequence, ``topk=gkd_logits_topk``, no multimodal inputs. It returns ``[batch,
    longest - 1, topk]`` log-probs and ids (row p scores the token after p, by rank) and each
    sequence's length; a shorter sequence's rows past its end are ``-inf`` / id 0. ms-swift sends
    ``temperature: 0``, which leaves the scores unscaled on a server in processed_logprobs mode too
    (greedy, as vLLM treats it), so one teacher serves TRL and ms-swift alike."""
    import torch

    server = request.getfixturevalue(which)
    fetch = fetch_teacher_logprobs()
    k = 8
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (37, 22)]
    logprobs, indices, seq_lens = fetch(server.url, seqs, topk=k, mm_raw_inputs=None)
    assert seq_lens == [37, 22]
    assert logprobs.shape == indices.shape == (2, 36, k)
    assert logprobs.dtype == torch.float32 and indices.dtype == torch.long
    for b, toks in enumerate(seqs):
        ref = reference_logprobs(server.path, toks)
        n = len(toks) - 1
        top = np.argsort(-ref[:n], axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(indices[b, :n].numpy(), top)
        np.testing.assert_allclose(logprobs[b, :n].numpy(), np.take_along_axis(ref[:n], top, axis=1), atol=TOL)
        assert torch.isneginf(logprobs[b, n:]).all() and not indices[b, n:].any()


@pytest.mark.timeout(60)
def test_ms_swift_against_a_refusing_server_fails_fast(server) -> None:
    """A ``topk`` beyond ``max_logprobs`` is a 400, which ms-swift's session does not retry (it retries
    500, 502 and 503): the call fails at once, naming the failed sequences."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Failed indices: \[0, 1\]\..* 400 Client Error"):
        fetch_teacher_logprobs()(server.url, [[1, 2, 3], [4, 5]], topk=65)
    assert time.monotonic() - t0 < 10
