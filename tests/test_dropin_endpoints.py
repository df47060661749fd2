"""The trainers' endpoints on a live server: ``/v1/completions`` (vLLM's OpenAI shape) and
SGLang's ``/generate``, against the float32 transformers reference; text prompts and
``decoded_token`` through the checkpoint's tokenizer.json, a 400 naming what to do without
one; the JSON cap; the error shapes."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import assert_error
from conftest import LiveServer
from dropin_util import VOCAB, reference_logprobs, with_tokenizer

from teacher_server.config import Config

TOL = 1e-4


@pytest.fixture(scope="module")
def tok_server(checkpoints, tmp_path_factory):
    path = with_tokenizer(checkpoints["qwen3"], tmp_path_factory.mktemp("tok") / "qwen3tok")
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=512,
                 max_model_len=1024, max_logprobs=64, max_prompt_logprobs_entries=5000)
    with LiveServer(cfg) as s:
        s.path = path
        yield s


def test_completions_prompt_logprobs_echo_and_batch(tok_server) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (30, 75)]  # the second is chunked
    with tok_server.client() as c:
        r = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"], "prompt": prompts,
                                            "max_tokens": 1, "echo": True, "prompt_logprobs": 5,
                                            "temperature": 0.7, "logprobs": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["usage"] == {"prompt_tokens": 105, "completion_tokens": 2, "total_tokens": 107,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    for i, (toks, ch) in enumerate(zip(prompts, data["choices"])):
        ref = reference_logprobs(tok_server.path, toks)
        assert ch["index"] == i and ch["finish_reason"] == "length" and ch["prompt_token_ids"] == toks
        greedy = int(ref[-1].argmax())
        assert ch["token_ids"] == [greedy]
        assert ch["text"] == f" w{greedy}"  # echo with return_token_ids: vLLM leaves the prompt out of text; the
        # generated token's text as an incremental detokenizer gives it (the decoder's space before a word)
        plp = ch["prompt_logprobs"]
        assert len(plp) == len(toks) and plp[0] is None
        for j in range(1, len(toks)):
            entry = plp[j]
            keys = list(entry)
            assert keys[0] == str(toks[j])  # the actual token first
            row = ref[j - 1]
            top = np.argsort(-row, kind="stable")[:5]
            assert [int(k) for k in keys[1:]] == [t for t in top.tolist() if t != toks[j]]  # then the top-k by rank
            for k, v in entry.items():
                assert set(v) == {"logprob", "rank", "decoded_token"}
                assert abs(v["logprob"] - row[int(k)]) < TOL
                assert v["rank"] == int((row > row[int(k)]).sum()) + 1
                assert v["decoded_token"] == f"w{k}"
        lp = ch["logprobs"]
        assert lp["tokens"][:3] == [f"w{t}" for t in toks[:3]] and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:len(toks)], ref[np.arange(len(toks) - 1), toks[1:]],
                                   atol=TOL)
        assert abs(lp["token_logprobs"][-1] - ref[-1].max()) < TOL  # the generated (greedy) token
        assert len(lp["top_logprobs"][-1]) == 2 and lp["text_offset"][:2] == [0, len(f"w{toks[0]}")]


def test_completions_token_ids_text_prompt_and_max_tokens_0(tok_server) -> None:
    with tok_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "w5 w9 w11 w2", "max_tokens": 0, "prompt_logprobs": 0,
                                            "logprobs": 1, "echo": True, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["logprobs"]["tokens"] == ["token_id:5", "token_id:9", "token_id:11", "token_id:2"]
        assert [list(e) for e in ch["prompt_logprobs"][1:]] == [["9"], ["11"], ["2"]]  # k = 0: the actual only
        assert ch["prompt_logprobs"][1]["9"]["decoded_token"] == "w9"  # (vLLM's detokenized text, not token_id:)
        assert ch["text"] == "w5 w9 w11 w2" and ch["token_ids"] is None
        # no echo: the logprobs of the generated token alone (its row is the last position's)
        toks = [7, 300, 41, 9, 250]
        r = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "logprobs": 2})
    ref = reference_logprobs(tok_server.path, toks)
    lp = r.json()["choices"][0]["logprobs"]
    greedy = int(ref[-1].argmax())
    assert lp["tokens"] == [f"w{greedy}"] and abs(lp["token_logprobs"][0] - ref[-1, greedy]) < TOL
    assert list(lp["top_logprobs"][0]) == [f"w{t}" for t in np.argsort(-ref[-1], kind="stable")[:2]]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": [1, 2], "max_tokens": 5}, 400, "max_tokens"),
    ({"prompt": [1, 2], "prompt_logprobs": 65}, 400, "prompt_logprobs"),
    ({"prompt": [1, 2], "logprobs": -1}, 400, "logprobs"),
    ({"prompt": [1, VOCAB]}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": [1, 2], "model": "other"}, 404, "model"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream"),
    ({"prompt": [1, 2], "n": 2}, 400, "n"),
    ({"prompt": list(range(200)), "prompt_logprobs": 30}, 400, "prompt_logprobs"),  # the JSON cap
    ({}, 400, "prompt"),
])
def test_completions_errors(tok_server, body: dict, status: int, param: str) -> None:
    with tok_server.client() as c:
        assert_error(c.post("/v1/completions", json=body), status, param)


def test_the_json_cap_points_to_the_native_endpoint(tok_server) -> None:
    """Past max_prompt_logprobs_entries, one prompt or several: the message names the endpoint
    whose fields it suggests (/v1/completions has no prompt_logprob_token_ids)."""
    with tok_server.client() as c:
        for prompt in (list(range(200)), [list(range(100))] * 2):
            err = assert_error(c.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 30}), 400,
                               "prompt_logprobs", contains="max_prompt_logprobs_entries")
            assert "POST /inference/v1/generate with prompt_logprob_" in err["message"], err


def test_native_targets_on_zero_rows(qwen3_server) -> None:
    """A single token (or a start at the end) has no scored rows: [0, K] and [0] arrays, never null."""
    from apiutil import decode

    with qwen3_server.client() as c:
        r = c.post("/inference/v1/generate", json={"token_ids": [5], "sampling_params": {
            "prompt_logprob_topk": 3, "prompt_logprob_actual": True, "max_tokens": 0}})
        assert r.status_code == 200, r.text
        assert decode(r.json()["prompt_topk_token_ids"]).shape == (0, 3)
        assert decode(r.json()["prompt_actual_logprobs"]).shape == (0,)
        r = c.post("/inference/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": {
            "prompt_logprob_tail": True, "prompt_logprob_topk": 2, "prompt_logprob_start": 2}})
        assert r.status_code == 200 and decode(r.json()["prompt_tail_logprobs"]).shape == (0,)


def test_text_needs_a_tokenizer(qwen3_server) -> None:
    """The checkpoint has no tokenizer.json: text and token strings are a 400 saying to send ids."""
    with qwen3_server.client() as c:
        assert_error(c.post("/v1/completions", json={"prompt": "hello"}), 400, contains="token ids")
        assert_error(c.post("/v1/completions", json={"prompt": [1, 2], "logprobs": 1}), 400,
                     contains="return_tokens_as_token_ids")
        assert_error(c.post("/generate", json={"text": "hello"}), 400, contains="token ids")
        assert_error(c.post("/v1/completions", json={"prompt": "hello", "logprobs": 1}), 400,
                     contains="send the prompt as token ids and set return_tokens_as_token_ids=true")
        # the prompt is ids already: the message says what to change instead
        for r in (c.post("/generate", json={"input_ids": [1, 2], "return_text_in_logprobs": True}),
                  c.post("/v1/completions", json={"prompt": [1, 2], "logprobs": 1})):
            assert_error(r, 400)
            assert "token ids" not in r.json()["error"]["message"], r.json()
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "prompt_logprobs": 1, "max_tokens": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][1]["2"]["decoded_token"] is None


def test_sglang_generate(tok_server) -> None:
    rng = np.random.default_rng(1)
    toks = rng.integers(0, VOCAB, 40).tolist()
    ids = [3, 17, 400]
    ref = reference_logprobs(tok_server.path, toks)
    with tok_server.client() as c:
        r = c.post("/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                      "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 4,
                                      "token_ids_logprob": ids, "return_text_in_logprobs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        later = c.post("/generate", json={"input_ids": [toks, toks[:20]], "return_logprob": [True, False],
                                          "logprob_start_len": [25, 0], "sampling_params": {"max_new_tokens": 0}})
        assert later.status_code == 200, later.text
        assert_error(c.post("/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": 8}}),
                     400, "sampling_params.max_new_tokens")
        assert_error(c.post("/generate", json={"input_ids": [toks, toks], "logprob_start_len": [0]}),
                     400, "logprob_start_len")
        assert_error(c.post("/generate", json={"input_ids": toks, "return_logprob": True, "logprob_start_len": 0,
                                               "token_ids_logprob": [3, VOCAB]}), 400, "token_ids_logprob")
        assert_error(c.post("/generate", json={"input_ids": toks, "return_logprob": True, "logprob_start_len": 0,
                                               "top_logprobs_num": 65}), 400, "top_logprobs_num")
        assert_error(c.post("/generate", json={"input_ids": list(range(200)), "return_logprob": True,
                                               "logprob_start_len": 0, "top_logprobs_num": 30}),
                     400, "top_logprobs_num", contains="max_prompt_logprobs_entries")  # the JSON cap
        assert_error(c.post("/generate", json={"text": "w1", "input_ids": [1]}), 400, "input_ids")
        assert_error(c.post("/generate", json={"input_ids": toks, "sampling_params": {"skip_special_tokens": "no"}}),
                     400, "sampling_params.skip_special_tokens")
    meta = out["meta_info"]
    greedy = int(ref[-1].argmax())
    # text: SGLang's detokenizer decodes the generated ids after the prompt's last 5 (the word's space with it)
    assert out["output_ids"] == [greedy] and out["text"] == f" w{greedy}"
    assert meta["prompt_tokens"] == 40 and meta["completion_tokens"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    assert isinstance(meta["id"], str) and isinstance(meta["e2e_latency"], float)
    assert meta["weight_version"] == "default" and meta["total_retractions"] == 0 and meta["cached_tokens"] == 0
    itl = meta["input_token_logprobs"]
    assert len(itl) == 40 and itl[0] == [None, toks[0], f"w{toks[0]}"]
    np.testing.assert_allclose([e[0] for e in itl[1:]], ref[np.arange(39), toks[1:]], atol=TOL)
    assert [e[1] for e in itl] == toks
    top = meta["input_top_logprobs"]
    assert top[0] is None and len(top) == 40
    for p in (1, 20, 39):
        want = np.argsort(-ref[p - 1], kind="stable")[:4]
        assert [e[1] for e in top[p]] == want.tolist()
        np.testing.assert_allclose([e[0] for e in top[p]], ref[p - 1, want], atol=TOL)
        assert [e[2] for e in top[p]] == [f"w{t}" for t in want]
    tid = meta["input_token_ids_logprobs"]
    assert tid[0] is None
    np.testing.assert_allclose([[e[0] for e in row] for row in tid[1:]], ref[:39][:, ids], atol=TOL)
    assert abs(meta["output_token_logprobs"][0][0] - ref[-1].max()) < TOL
    assert [e[1] for e in meta["output_top_logprobs"][0]] == np.argsort(-ref[-1], kind="stable")[:4].tolist()
    first, second = later.json()
    assert len(first["meta_info"]["input_token_logprobs"]) == 15 and first["output_ids"] == []
    # as SGLang: the first position returned has no logprob, whatever logprob_start_len is
    assert first["meta_info"]["input_token_logprobs"][0] == [None, toks[25], None]
    np.testing.assert_allclose([e[0] for e in first["meta_info"]["input_token_logprobs"][1:]],
                               ref[np.arange(25, 39), toks[26:]], atol=TOL)
    assert first["meta_info"]["input_token_logprobs"][1][2] is None  # text only with return_text_in_logprobs
    assert "input_token_logprobs" not in second["meta_info"]


def test_prompt_logprobs_json_equals_the_entries_as_dicts() -> None:
    """The byte-template builder gives what serialising the entries as dicts gives: the actual
    token first, then the top-k by rank without it (where it is among them, its top-k entry in
    its place, as vLLM's dict by id has it), -inf as -9999.0 (a finite value below it kept, as
    vLLM's prompt_logprobs keep it: processed log-probs at a tiny temperature reach -76,000),
    decoded tokens escaped."""
    import orjson

    from teacher_server.engine.request import ScoreRequest, ScoreResult
    from teacher_server.server.completions import _Names, prompt_logprobs_json

    rng = np.random.default_rng(3)
    n, k = 700, 5  # more than one slice
    toks = rng.integers(0, 50, n)
    req = ScoreRequest("r", toks, prompt_logprobs=k)
    res = ScoreResult.empty_for(req)
    res.plp_token_logprob[:] = -rng.random(n - 1) * 5
    res.plp_token_logprob[3] = -np.inf
    res.plp_token_logprob[4] = -12345.5
    res.plp_token_rank[:] = rng.integers(1, 50, n - 1)
    for j in range(n - 1):
        res.plp_topk_ids[j] = rng.choice(50, k, replace=False)
    res.plp_topk_logprobs[:] = -np.sort(rng.random((n - 1, k)) * 5, axis=1)
    res.plp_topk_logprobs[5, -1] = -np.inf
    res.plp_topk_logprobs[6, -1] = -76775.75

    class Tok:
        def pieces(self, ids):
            return {i: f'w"{i}\\n' for i in ids}  # characters JSON must escape

    def finite(v: float) -> float:
        return v if np.isfinite(v) else -9999.0

    names = _Names(Tok(), False, np.arange(50))
    want = [None]
    for j in range(1, n):
        t = int(toks[j])
        e = {str(t): {"logprob": finite(float(res.plp_token_logprob[j - 1])),
                      "rank": int(res.plp_token_rank[j - 1]), "decoded_token": names(t)}}
        # vLLM's dict: a top-k entry of the actual token replaces its own, in its place
        for r, (i, v) in enumerate(zip(res.plp_topk_ids[j - 1].tolist(), res.plp_topk_logprobs[j - 1].tolist()), 1):
            e[str(i)] = {"logprob": finite(v), "rank": r, "decoded_token": names(i)}
        want.append(e)
    got = prompt_logprobs_json(req, res, k, names)
    assert got == orjson.dumps(want)


def test_a_log_prob_below_minus_9999_is_written_as_it_is(checkpoints) -> None:
    """In processed_logprobs mode at a tiny temperature the log-probs reach far below -9999:
    ``prompt_logprobs`` (native and /v1/completions, as vLLM replaces only -inf) and SGLang's
    input logprobs give them as they are, the same on the three endpoints."""
    cfg = Config(model=str(checkpoints["qwen3"]), device="cpu", max_num_batched_tokens=64, block_size=8,
                 num_kv_blocks=128, max_model_len=256, max_logprobs=8, logprobs_mode="processed_logprobs")
    toks = [1, 5, 9, 100, 200, 300, 7, 8]
    with LiveServer(cfg) as s, s.client() as c:
        native = c.post("/inference/v1/generate", json={"token_ids": toks, "sampling_params": {
            "prompt_logprobs": 2, "temperature": 1e-4, "max_tokens": 1}})
        comp = c.post("/v1/completions", json={"prompt": toks, "prompt_logprobs": 2, "temperature": 1e-4,
                                               "max_tokens": 1})
        sgl = c.post("/generate", json={"input_ids": toks, "return_logprob": True, "logprob_start_len": 0,
                                        "sampling_params": {"temperature": 1e-4, "max_new_tokens": 1}})
    assert native.status_code == comp.status_code == sgl.status_code == 200, (native.text, comp.text, sgl.text)
    want = [float(e[str(t)]["logprob"]) for e, t in zip(native.json()["prompt_logprobs"][1:], toks[1:])]
    assert min(want) < -10000 and all(np.isfinite(want))
    got = [float(e[str(t)]["logprob"]) for e, t in zip(comp.json()["choices"][0]["prompt_logprobs"][1:], toks[1:])]
    assert got == want
    assert [e[0] for e in sgl.json()["meta_info"]["input_token_logprobs"][1:]] == want


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("special", [True, False])
def test_a_text_prompt_is_cut_as_a_hugging_face_tokenizer_cuts_it(side: str, special: bool) -> None:
    """truncate_prompt_tokens on a text prompt, as vLLM's tokenizer call truncates: the
    special tokens (a BOS here) are added after the cut and count within the k."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, processors

    from teacher_server.server.tokenizer import Tokenizer

    def make() -> HF:
        t = HF(models.WordLevel({"<s>": 0, **{f"w{i}": i + 1 for i in range(9)}, "<unk>": 10}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        return t

    text = "w1 w2 w3 w4 w5 w6"
    ours = Tokenizer(make())
    for keep in (1, 3, 6, 7, 20):
        theirs = make()
        theirs.enable_truncation(keep, direction=side)
        assert ours.encode(text, special, keep, side) == theirs.encode(text, add_special_tokens=special).ids, keep
    assert ours.encode(text, True, 3, "left") == [0, 6, 7]  # (the BOS, then the last two words, w5 and w6)
