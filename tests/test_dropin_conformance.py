"""The trainers' endpoints where vLLM and SGLang have a rule of their own, each case as the real
server answers it (the source read for it named in the test):

- SGLang ``/generate``: the first position returned from ``logprob_start_len`` has no logprob
  (SGLang pads it with None whatever the start), the given ids' logprobs at the generated token
  (``output_token_ids_logprobs``), a start past the input is an error, one ``rid``
  over a batch becomes ``rid_i``, ``sampling_params.n`` > 1 is refused (nothing is sampled), PUT
  is served as POST;
- vLLM ``/v1/completions``: ``-1`` for the full vocabulary, ``echo: null``, ``echo`` with
  ``logprobs`` fills ``prompt_logprobs`` too and keeps ``logprobs + 1`` entries of each prompt
  position, ``echo`` with ``return_token_ids`` leaves the prompt out of ``text``,
  ``decoded_token`` is the tokenizer's text whatever ``return_tokens_as_token_ids`` says,
  ``logprob_token_ids`` gives the generated token's ``top_logprobs`` over the given ids;
- the native endpoint: ``prompt_logprobs: -1`` (ragged candidate rows stay a 400: the contract asks for
  rows of K ids each, -1 padding given by the caller)."""

from __future__ import annotations

import numpy as np
import pytest
from apiutil import assert_error
from conftest import LiveServer
from dropin_util import VOCAB, reference_logprobs, with_tokenizer

from teacher_server.config import Config

TOL = 1e-4


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path = with_tokenizer(checkpoints["qwen3"], tmp_path_factory.mktemp("tok") / "qwen3tok")
    cfg = Config(model=str(path), device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=512,
                 max_model_len=1024, max_logprobs=-1, max_prompt_logprobs_entries=40000)
    with LiveServer(cfg) as s:
        s.path = path
        yield s


@pytest.fixture(scope="module")
def toks() -> list[int]:
    return np.random.default_rng(5).integers(0, VOCAB, 30).tolist()


@pytest.fixture(scope="module")
def ref(server, toks) -> np.ndarray:
    return reference_logprobs(server.path, toks)


# --- SGLang /generate ------------------------------------------------------------------------


def test_sglang_first_returned_position_has_no_logprob(server, toks, ref) -> None:
    """SGLang's scheduler pads the first returned position with None and drops the last
    computed row (the sampled token's): input_token_logprobs[i] is [lp or None, ids[start + i],
    text], entry 0 None for every start (python/sglang/srt/managers/
    scheduler_output_processor_mixin.py, ``_process_input_token_logprobs`` and its top /
    token-ids siblings)."""
    ids = [3, 17]
    start = 11
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                                      "token_ids_logprob": ids})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    itl, top, tid = meta["input_token_logprobs"], meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(itl) == len(top) == len(tid) == len(toks) - start
    assert itl[0] == [None, toks[start], None] and top[0] is None and tid[0] is None
    assert [e[1] for e in itl] == toks[start:]
    np.testing.assert_allclose([e[0] for e in itl[1:]], ref[np.arange(start, len(toks) - 1), toks[start + 1:]],
                               atol=TOL)
    for i in (1, 5, len(itl) - 1):
        p = start + i  # scored by the row of position p - 1
        want = np.argsort(-ref[p - 1], kind="stable")[:2]
        assert [e[1] for e in top[i]] == want.tolist()
        np.testing.assert_allclose([e[0] for e in tid[i]], ref[p - 1, ids], atol=TOL)


@pytest.mark.parametrize("start", [0, -1])
def test_sglang_given_ids_at_the_generated_token(server, toks, ref, start: int) -> None:
    """SGLang answers output_token_ids_logprobs for each generated token: the given ids'
    [logprob, id, text] at its position (the scheduler appends
    next_token_token_ids_logprobs_val per decoded token), with or without input positions."""
    ids = [3, 17, 400]
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": 1},
                                      "return_logprob": True, "logprob_start_len": start, "token_ids_logprob": ids})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    (out,) = meta["output_token_ids_logprobs"]
    assert [e[1] for e in out] == ids
    np.testing.assert_allclose([e[0] for e in out], ref[-1, ids], atol=TOL)
    assert r.json()["output_ids"] == [int(ref[-1].argmax())]
    assert len(meta["input_token_ids_logprobs"]) == (len(toks) if start == 0 else 1)  # (-1: the last position alone)
    if start == 0:
        np.testing.assert_allclose([[e[0] for e in row] for row in meta["input_token_ids_logprobs"][1:]],
                                   ref[:-1][:, ids], atol=TOL)


@pytest.mark.parametrize(("start", "new", "entries"), [(29, 1, 1), (-1, 1, 1), (30, 0, 0), (-1, 0, 0), (30, 1, None),
                                                     (31, 0, 0), (31, 1, None)])
def test_sglang_start_at_the_end(server, toks, start: int, new: int, entries: int | None) -> None:
    """As SGLang's scheduler reads the start: at the last input position (-1, the default, is that
    position) it returns it alone, without a logprob; a prefill-only request (max_new_tokens 0)
    at -1 or at or past the input's length returns nothing; the input's length or more with a
    token to generate is its error (the start must be less)."""
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": new},
                                      "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 1})
    if entries is None:
        assert_error(r, 400, "logprob_start_len")
        return
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, toks[-1], None]] * entries
    assert meta["input_top_logprobs"] == [None] * entries
    assert len(meta["output_token_logprobs"]) == new


def test_sglang_refusals_and_batch_ids(server, toks) -> None:
    """A start past the input is SGLang's error ("logprob_start_len ... is higher than the
    number of input tokens"); ignored without return_logprob, as SGLang ignores the start then.
    One rid over a batch is SGLang's ``rid_i`` per prompt (GenerateReqInput._normalize_rid); n
    samples are refused, nothing being sampled; PUT is POST (SGLang's route takes both)."""
    with server.client() as c:
        assert_error(c.post("/generate", json={"input_ids": toks, "return_logprob": True,
                                               "logprob_start_len": 31}), 400, "logprob_start_len")
        assert c.post("/generate", json={"input_ids": toks, "logprob_start_len": 31}).status_code == 200
        assert_error(c.post("/generate", json={"input_ids": toks, "sampling_params": {"n": 2}}),
                     400, "sampling_params.n")
        r = c.post("/generate", json={"input_ids": [toks, toks[:5]], "rid": "job",
                                      "sampling_params": {"max_new_tokens": 0, "n": 1}})
        assert r.status_code == 200, r.text
        assert [o["meta_info"]["id"] for o in r.json()] == ["job_0", "job_1"]
        r = c.post("/generate", json={"input_ids": toks[:5], "rid": "one"})
        assert r.json()["meta_info"]["id"] == "one"
        r = c.put("/generate", json={"input_ids": toks[:5], "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == []
        # null (SGLang's "no limit") is 1 here, as absent is
        r = c.post("/generate", json={"input_ids": toks[:5], "sampling_params": {"max_new_tokens": None}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 1


# --- vLLM /v1/completions --------------------------------------------------------------------


def _vllm_entry(row: np.ndarray, actual: int, k: int) -> list[int]:
    """vLLM's prompt_logprobs entry of one position as ids, in order: a dict by id of the actual
    token, then the top-k (vllm/logprobs.py ``append_logprobs_for_next_position``)."""
    top = np.argsort(-row, kind="stable")[:k].tolist()
    return list(dict.fromkeys([actual] + top))


def test_completions_minus_one_is_the_whole_vocabulary(server) -> None:
    """``prompt_logprobs: -1`` and ``logprobs: -1`` ask for every id (vLLM's request check
    admits -1 and nothing else below 0; its processor counts -1 as the vocabulary's size)."""
    toks = [7, 300, 41, 9, 250]
    ref = reference_logprobs(server.path, toks)
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "prompt_logprobs": -1, "logprobs": -1,
                                            "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        assert_error(c.post("/v1/completions", json={"prompt": toks, "prompt_logprobs": -2}), 400, "prompt_logprobs")
        assert_error(c.post("/v1/completions", json={"prompt": toks, "logprobs": -3}), 400, "logprobs")
    ch = r.json()["choices"][0]
    for j in range(1, len(toks)):
        entry = ch["prompt_logprobs"][j]
        assert len(entry) == VOCAB and next(iter(entry)) == str(toks[j])
        assert sorted(v["rank"] for v in entry.values()) == list(range(1, VOCAB + 1))
        np.testing.assert_allclose([entry[str(i)]["logprob"] for i in range(VOCAB)], ref[j - 1], atol=TOL)
    assert len(ch["logprobs"]["top_logprobs"][0]) == VOCAB  # the generated token's: every id


def test_minus_one_within_max_logprobs() -> None:
    """-1 is the vocabulary's size, refused beyond max_logprobs as vLLM refuses it."""
    from teacher_server.server.completions import parse_completion
    from teacher_server.validation import BadRequest, Limits

    limits = Limits(vocab_size=VOCAB, max_model_len=64, max_logprobs=20, max_rows_x_k=10 ** 6)
    for name in ("prompt_logprobs", "logprobs"):
        with pytest.raises(BadRequest) as e:
            parse_completion(b'{"prompt": [1, 2], "return_tokens_as_token_ids": true, "%s": -1}' % name.encode(),
                             limits, "m", None)
        assert e.value.param == name and f"of {VOCAB}, which is greater than max allowed: 20" in e.value.message
    from teacher_server.validation import build_request

    with pytest.raises(BadRequest) as e:  # the native endpoint's (and the in-process LLM's) rule
        build_request(token_ids=[1, 2], limits=limits, prompt_logprobs=-1)
    assert e.value.param == "sampling_params.prompt_logprobs" and e.value.message.startswith(
        f"prompt_logprobs=-1 asks for every id ({VOCAB}), more than max_logprobs=20 allows: ask for at most 20, "
        "or start the server with --max-logprobs -1"), e.value.message
    assert build_request(token_ids=[1, 2], limits=limits, prompt_logprobs=20).prompt_logprobs == 20


def test_completions_echo_and_logprobs(server, toks, ref) -> None:
    """vLLM (CompletionRequest.to_sampling_params, request_output_to_completion_response):
    echo with logprobs and no prompt_logprobs asks the prompt's with k = logprobs, returned in
    prompt_logprobs too; an echoed position's top_logprobs is the first logprobs + 1 entries of
    its prompt_logprobs entry; ``echo: null`` is no echo."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 0, "echo": True, "logprobs": 2,
                                            "return_tokens_as_token_ids": True})
        wide = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 0, "echo": True, "logprobs": 1,
                                               "prompt_logprobs": 4, "return_tokens_as_token_ids": True})
        plain = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 0, "echo": None})
    assert r.status_code == wide.status_code == plain.status_code == 200, (r.text, wide.text, plain.text)
    ch = r.json()["choices"][0]
    assert ch["prompt_logprobs"][0] is None and len(ch["prompt_logprobs"]) == len(toks)
    for j in range(1, len(toks)):
        want = _vllm_entry(ref[j - 1], toks[j], 2)
        assert [int(t) for t in ch["prompt_logprobs"][j]] == want
        assert list(ch["logprobs"]["top_logprobs"][j]) == [f"token_id:{t}" for t in want]
    ch = wide.json()["choices"][0]
    for j in range(1, len(toks)):
        want = _vllm_entry(ref[j - 1], toks[j], 4)
        assert [int(t) for t in ch["prompt_logprobs"][j]] == want
        assert list(ch["logprobs"]["top_logprobs"][j]) == [f"token_id:{t}" for t in want[:2]]
        np.testing.assert_allclose(list(ch["logprobs"]["top_logprobs"][j].values()), ref[j - 1, want[:2]], atol=TOL)
    ch = plain.json()["choices"][0]
    assert ch["text"] == "" and ch["prompt_logprobs"] is None and ch["logprobs"] is None


def _stream_text(server, prompt: list[int], ids: list[int], skip_special_tokens: bool = True) -> str:
    """What tokenizers' DecodeStream (vLLM's fast incremental detokenizer) gives for ``ids``
    after a stream primed with the prompt's last ids."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(str(server.path / "tokenizer.json"))
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    for t in prompt[-4:]:
        stream.step(tok, t)
    return "".join(stream.step(tok, t) or "" for t in ids)


def test_completions_text_decoded_token_and_refusals(server, toks, ref) -> None:
    """Echo puts the prompt in text unless return_token_ids (vLLM then leaves it out);
    decoded_token is the detokenizer's text whatever return_tokens_as_token_ids says (vLLM
    writes token_id: only in logprobs)."""
    greedy = int(ref[-1].argmax())
    with server.client() as c:
        echo = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "echo": True}).json()
        ids = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "echo": True, "return_token_ids": True,
                                              "prompt_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    assert echo["choices"][0]["text"] == " ".join(f"w{t}" for t in toks + [greedy])
    ch = ids["choices"][0]
    # the generated token's text as vLLM's incremental detokenizer gives it after the prompt: with
    # the decoder's space before a word, as tokenizers' DecodeStream primed with the prompt gives it
    ch_text = _stream_text(server, toks, [greedy])
    assert ch_text == f" w{greedy}"
    assert ch["text"] == ch_text and ch["prompt_token_ids"] == toks and ch["token_ids"] == [greedy]
    assert {v["decoded_token"] for e in ch["prompt_logprobs"][1:] for v in e.values()} \
        == {f"w{t}" for e in ch["prompt_logprobs"][1:] for t in e}


def test_completions_echo_of_a_text_prompt_is_the_text_as_sent(server, toks, ref) -> None:
    """vLLM echoes a text prompt as sent (its renderer keeps the string beside the ids), not
    its ids decoded: spacing the tokenizer does not keep comes back, and so does the whole text
    where truncate_prompt_tokens cut the ids; the generated token's text follows."""
    text = "  w5   w9\tw11  w2"  # (decoded, its ids would read "w5 w9 w11 w2")
    greedy = int(reference_logprobs(server.path, [5, 9, 11, 2])[-1].argmax())
    with server.client() as c:
        only = c.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True}).json()
        cut = c.post("/v1/completions", json={"prompt": [text, "w3 w4"], "max_tokens": 1, "echo": True,
                                              "truncate_prompt_tokens": 2}).json()
        both = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "echo": True}).json()
    assert only["choices"][0]["text"] == text
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"].startswith(text)
    assert cut["choices"][1]["text"].startswith("w3 w4")
    assert both["choices"][0]["text"] == text + _stream_text(server, [5, 9, 11, 2], [greedy])


def test_continuation_is_the_incremental_detokenizers(tmp_path) -> None:
    """Tokenizer.continuation against tokenizers' DecodeStream primed with the context, vLLM's
    fast detokenizer: the space before a word comes with it; a special token is left out with
    skip_special_tokens (vLLM's default for the generated text) and kept without it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.decoders import DecodeStream

    from teacher_server.server.tokenizer import Tokenizer as Ours

    inner = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.decoder = decoders.WordPiece(prefix="##")
    inner.add_special_tokens([AddedToken("w1", special=True)])
    ours = Ours(inner)
    for context, ids in (([5, 9, 11, 2], [7]), ([5, 9, 11, 2, 6, 8], [7, 1, 3]), ([4], [9]), ([], [3, 4])):
        for skip in (True, False):
            stream = DecodeStream(skip_special_tokens=skip)
            for t in context[-4:]:
                stream.step(inner, t)
            want = "".join(stream.step(inner, t) or "" for t in ids)
            assert ours.continuation(context, ids, skip) == want, (context, ids, skip)
    assert ours.continuation([5, 9], [1], True) == "" and ours.continuation([5, 9], [1], False) == " w1"


def test_continuation_of_a_character_split_across_tokens() -> None:
    """Byte-level BPE (Qwen's, Llama 3's) splits a character the vocabulary lacks into byte
    tokens. vLLM's detokenizer adds no text for a piece until the character is whole, so a
    greedy token that starts an emoji is "", and one that completes it (the prompt ending
    within it, as a rollout cut anywhere does) is the whole emoji, never U+FFFD. SGLang's
    decodes after the last 5 ids and slices off their text, unchecked."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from teacher_server.server.tokenizer import Tokenizer as Ours

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator(["hello world, a naive cafe"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ids = inner.encode("hello world \U0001F600").ids
    ctx, emoji = ids[:-4], ids[-4:]  # (its four bytes, one token each)
    assert inner.decode(emoji) == "\U0001F600" and all(inner.decode([i]) == "\ufffd" for i in emoji)
    ours = Ours(inner)
    assert ours.continuation(ctx, emoji[:1]) == ""
    assert ours.continuation(ctx + emoji[:3], emoji[3:]) == "\U0001F600"
    assert ours.continuation(ctx, emoji) == "\U0001F600"
    assert ours.continuation(ctx + emoji[:3], emoji[3:], last=5) == ""  # SGLang: the emoji's length is its piece's
    assert ours.continuation(ctx, [ids[1]], last=5) == " world"


def test_completions_logprob_token_ids(server, toks, ref) -> None:
    """vLLM's logprob_token_ids (CompletionRequest.check_logprobs and _create_completion_logprobs):
    the generated token's top_logprobs hold the token, then the given ids, none cut to
    logprobs + 1; empty, without logprobs, or with echo and max_tokens 0: 400."""
    greedy = int(ref[-1].argmax())
    given = [3, 4, greedy, 400]
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "logprobs": 1,
                                            "logprob_token_ids": given, "return_tokens_as_token_ids": True})
        for bad in ({"logprob_token_ids": []}, {"logprob_token_ids": [3], "logprobs": None},
                    {"logprob_token_ids": [3], "echo": True, "max_tokens": 0}, {"logprob_token_ids": [3, VOCAB]}):
            assert_error(c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "logprobs": 1, **bad}),
                         400, "logprob_token_ids")
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{greedy}"]
    (top,) = lp["top_logprobs"]
    assert list(top) == [f"token_id:{t}" for t in dict.fromkeys([greedy, *given])]
    np.testing.assert_allclose([top[f"token_id:{t}"] for t in given], ref[-1, given], atol=TOL)
    assert abs(lp["token_logprobs"][0] - ref[-1, greedy]) < TOL
    with server.client() as c:  # the same with the tokenizer's strings; logprobs 0 alone: the token alone
        r = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "logprobs": 0, "logprob_token_ids": [411]})
        zero = c.post("/v1/completions", json={"prompt": toks, "max_tokens": 1, "logprobs": 0})
    assert r.status_code == zero.status_code == 200, (r.text, zero.text)
    assert list(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == [f"w{greedy}", "w411"]
    assert list(zero.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == [f"w{greedy}"]

# --- POST /inference/v1/generate (vLLM's teacher scoring) -------------------------------------


def test_native_prompt_logprobs_minus_one(server) -> None:
    """vLLM's SamplingParams takes prompt_logprobs -1 for every id (its processor counts it as
    the vocabulary's size)."""
    toks = [7, 300, 41]
    with server.client() as c:
        r = c.post("/inference/v1/generate", json={"token_ids": toks, "sampling_params": {
            "prompt_logprobs": -1, "max_tokens": 0}})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and [len(e) for e in plp[1:]] == [VOCAB, VOCAB]
    assert [next(iter(e)) for e in plp[1:]] == ["300", "41"]


def test_completions_id_from_the_request_id_header(server) -> None:
    """vLLM names a completion ``cmpl-`` + X-Request-Id when the header is there, else the
    body's request_id (OpenAIServing._base_request_id); SGLang reads no header."""
    with server.client() as c:
        both = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 0, "request_id": "body"},
                      headers={"X-Request-Id": "hdr"})
        body = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 0, "request_id": "body"})
        sgl = c.post("/generate", json={"input_ids": [1, 2], "rid": "r"}, headers={"X-Request-Id": "hdr"})
    assert both.json()["id"] == "cmpl-hdr" and body.json()["id"] == "cmpl-body"
    assert sgl.json()["meta_info"]["id"] == "r"


def test_openai_client_reads_what_vllm_sends(server, toks, ref) -> None:
    """The ``openai`` package's completions.create, as a trainer written for vLLM calls it: vLLM's
    extra fields through extra_body and extra_headers, read back from the client's models."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    greedy = int(ref[-1].argmax())
    out = client.completions.create(model=client.models.list().data[0].id, prompt=toks, max_tokens=1, echo=True,
                                    logprobs=2, extra_headers={"X-Request-Id": "trainer-7"},
                                    extra_body={"logprob_token_ids": [3, 4], "return_tokens_as_token_ids": True})
    assert out.id == "cmpl-trainer-7"
    (ch,) = out.choices
    assert ch.prompt_logprobs[0] is None and len(ch.prompt_logprobs) == len(toks)  # filled by echo + logprobs
    assert [int(t) for t in ch.prompt_logprobs[1]] == _vllm_entry(ref[0], toks[1], 2)
    assert list(ch.logprobs.top_logprobs[-1]) == [f"token_id:{t}" for t in (greedy, 3, 4)]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=out.model, prompt=toks, max_tokens=1,
                                  extra_body={"prompt_logprobs": -2})
    assert e.value.body["param"] == "prompt_logprobs"


def test_native_n_samples_refused(server, toks) -> None:
    """vLLM answers sampling_params.n choices, each sampled: nothing is sampled here, so n > 1 is
    a 400 naming it rather than one choice where n were asked."""
    with server.client() as c:
        assert_error(c.post("/inference/v1/generate", json={"token_ids": toks, "sampling_params": {"n": 4}}),
                     400, "sampling_params.n")
        assert c.post("/inference/v1/generate", json={"token_ids": toks, "sampling_params": {"n": 1}}).status_code \
            == 200
