"""Black-box: two teachers behind one port (the demo model, vocabulary 4096; a tiny Qwen3,
vocabulary 512), each with limits of its own. In one burst over the three scoring endpoints,
requests naming either teacher beside requests valid for one teacher only and clients that
hang up: each answer is the named teacher's (equal to that teacher served alone), each
request past its teacher's limits a 400 even where the other teacher would take it, and a
body naming a teacher twice is scored by the one its answer reports."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from apiutil import assert_error
from blackbox_util import assert_same, hang_ups
from conftest import LiveServer

from teacher_server.config import Config

GEN, COMP, SGL = "/inference/v1/generate", "/v1/completions", "/generate"
VOCAB = {"demo": 4096, "qwen": 512}
MAX_LEN = {"demo": 96, "qwen": 64}
MAX_K = {"demo": 16, "qwen": 8}


@pytest.fixture(scope="module")
def two(demo_server, qwen3_server):
    cfg = Config(device="cpu", max_num_batched_tokens=128, block_size=8, num_kv_blocks=512,
                 teachers=[{"name": "demo", "demo_model_dir": demo_server.cfg.demo_model_dir,
                            "max_model_len": MAX_LEN["demo"], "max_logprobs": MAX_K["demo"]},
                           {"name": "qwen", "model": qwen3_server.cfg.model,
                            "max_model_len": MAX_LEN["qwen"], "max_logprobs": MAX_K["qwen"]}])
    with LiveServer(cfg) as s:
        yield s


def _body(name: str, kind: int, rng: np.random.Generator) -> tuple[str, dict]:
    ids = rng.integers(0, VOCAB[name], int(rng.integers(1, MAX_LEN[name] + 1))).tolist()
    start = int(rng.integers(0, len(ids)))
    k = MAX_K[name]
    if kind == 0:
        rows = len(ids) - 1 - start
        cands = rng.integers(-1, VOCAB[name], (rows, 3)).tolist() if rows > 0 else [1, 2, 3]
        return GEN, {"token_ids": ids, "sampling_params": {"prompt_logprob_start": start, "prompt_logprob_token_ids": cands,
                                                           "prompt_logprob_topk": k, "prompt_logprob_tail": True}}
    if kind == 1:
        return COMP, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": k}
    return SGL, {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": k,
                 "sampling_params": {"max_new_tokens": 1}}


def _past_one_teachers_limits() -> list[tuple[str, dict, str]]:
    """Requests the demo teacher would take, past the Qwen teacher's limits; and one past the
    demo teacher's own length (path, body, the field named)."""
    return [(GEN, {"model": "qwen", "token_ids": [1, VOCAB["qwen"]], "sampling_params": {}}, "token_ids"),
            (GEN, {"model": "qwen", "token_ids": [1] * (MAX_LEN["qwen"] + 1), "sampling_params": {}}, "token_ids"),
            (GEN, {"model": "qwen", "token_ids": [1, 2], "sampling_params": {"prompt_logprob_topk": MAX_K["qwen"] + 1}},
             "sampling_params.prompt_logprob_topk"),
            (COMP, {"model": "qwen", "prompt": [1, VOCAB["qwen"]], "max_tokens": 0}, "prompt"),
            (COMP, {"model": "qwen", "prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": MAX_K["qwen"] + 1},
             "prompt_logprobs"),
            (SGL, {"model": "qwen", "input_ids": [1, VOCAB["qwen"]], "return_logprob": True}, "input_ids"),
            (SGL, {"model": "demo", "input_ids": [1] * (MAX_LEN["demo"] + 1), "return_logprob": True}, "input_ids")]


def test_a_burst_over_both_teachers_is_scored_by_each_named_one(two, demo_server, qwen3_server) -> None:
    rng = np.random.default_rng(3)
    asked = [(name, *_body(name, i % 3, rng)) for i in range(36) for name in [("demo", "qwen")[i % 2]]]
    alone = []
    for name, path, b in asked:
        single = demo_server if name == "demo" else qwen3_server
        r = httpx.post(single.url + path, json=b, timeout=60)
        assert r.status_code == 200, r.text[:300]
        alone.append(r.json())
    refused = _past_one_teachers_limits()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=two.url, timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            calls = [c.post(p, json={**b, "model": n}) for n, p, b in asked] + [c.post(p, json=b) for p, b, _ in refused]
            hang = hang_ups(two.port, [(p, {**b, "model": n}) for n, p, b in asked[:8]])
            return (await asyncio.gather(*calls, *hang))[:len(calls)]

    got = asyncio.run(burst())
    for (name, path, _), a, r in zip(asked, alone, got):
        assert r.status_code == 200, (name, path, r.text[:300])
        if path != SGL:  # (SGLang's answer does not name a model)
            assert r.json()["model"] == name
        assert_same({k: v for k, v in a.items() if k != "model"}, {k: v for k, v in r.json().items() if k != "model"})
    for (_, _, param), r in zip(refused, got[len(asked):]):
        assert_error(r, 400, param)
    health = httpx.get(two.url + "/health").json()
    assert health["status"] == "ready" and set(health["teachers"]) == {"demo", "qwen"}


@pytest.mark.parametrize("path", [GEN, COMP, SGL])
def test_a_body_naming_two_teachers_is_scored_by_the_one_it_reports(two, demo_server, qwen3_server, path) -> None:
    """JSON's last duplicate key wins in every parser the body meets (routing and the
    endpoint's): the answer is that teacher's, never one teacher's scores under the other's name."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    body = {GEN: {"token_ids": ids, "sampling_params": {"prompt_logprob_token_ids": [7, 8], "prompt_logprob_topk": 4}},
            COMP: {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 4},
            SGL: {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 4,
                  "sampling_params": {"max_new_tokens": 1}}}[path]
    for first, last, single in (("qwen", "demo", demo_server), ("demo", "qwen", qwen3_server)):
        raw = json.dumps({"model": first, **body})[:-1] + f', "model": "{last}"}}'
        r = httpx.post(two.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        if path != SGL:
            assert r.json()["model"] == last
        alone = httpx.post(single.url + path, json=body, timeout=60).json()
        assert_same({k: v for k, v in alone.items() if k != "model"}, {k: v for k, v in r.json().items() if k != "model"})
