"""Black-box checks of bad inputs and boundary lengths over HTTP, on the three scoring
endpoints of one live server (a tiny Qwen3, vocabulary 512, max_model_len 64, in
``processed_logprobs`` mode so that a request's sampling temperature matters): every bad input
is a 4xx in the documented error shape naming the field, nothing is cut off or misread, and
the server serves the same answers afterwards. ``max_rows_x_k`` is the largest result of one
max_model_len request, [max_model_len - 1, max_logprobs]; the queue holds QUEUE requests, so a batch of more prompts could
never be admitted."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from apiutil import assert_error, decode, npy_b64
from conftest import LiveServer

from teacher_server.config import Config

VOCAB, MAX_LEN, MAX_K = 512, 64, 8
MAX_ROWS_X_K = (MAX_LEN - 1) * MAX_K
QUEUE = 16
GEN, COMP, SGL = "/inference/v1/generate", "/v1/completions", "/generate"
IDS = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def server(checkpoints):
    cfg = Config(model=str(checkpoints["qwen3"]), device="cpu", max_num_batched_tokens=32, block_size=8,
                 num_kv_blocks=256, max_model_len=MAX_LEN, max_logprobs=MAX_K, max_rows_x_k=MAX_ROWS_X_K,
                 max_queue_requests=QUEUE, logprobs_mode="processed_logprobs")
    with LiveServer(cfg) as s, s.client() as c:
        s.c = c
        yield s


def _npy_with_header_shape(data: np.ndarray, shape: tuple[int, ...]) -> str:
    """A .npy whose header says ``shape`` and whose data is all of ``data`` (a writer's bug)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False, "shape": shape})
    buf.write(np.ascontiguousarray(data, dtype="<i4").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _gen(**sp) -> dict:
    return {"token_ids": IDS, "sampling_params": sp}


_COMP = {"prompt": IDS, "max_tokens": 0, "prompt_logprobs": 2}
_SGL = {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
_ROWS = len(IDS) - 1

BAD = [
    # (case, path, body, status, param)
    ("id = vocab", GEN, {"token_ids": [1, VOCAB]}, 400, "token_ids"),
    ("negative id", GEN, {"token_ids": [1, -3]}, 400, "token_ids"),
    ("id past int64", GEN, {"token_ids": [1, 2**63]}, 400, "token_ids"),
    ("one over max_model_len", GEN, {"token_ids": [1] * (MAX_LEN + 1)}, 400, "token_ids"),
    ("K = 0", GEN, _gen(prompt_logprob_token_ids=[[]] * _ROWS), 400, "sampling_params.prompt_logprob_token_ids"),
    ("K > max_logprobs", GEN, _gen(prompt_logprob_token_ids=list(range(MAX_K + 1))), 400,
     "sampling_params.prompt_logprob_token_ids"),
    ("K > vocab", GEN, _gen(prompt_logprob_topk=VOCAB + 1), 400, "sampling_params.prompt_logprob_topk"),
    ("a row short", GEN, _gen(prompt_logprob_token_ids=[[1]] * (_ROWS - 1)), 400,
     "sampling_params.prompt_logprob_token_ids"),
    ("ragged rows", GEN, _gen(prompt_logprob_token_ids=[[1, 2]] + [[1]] * (_ROWS - 1)), 400,
     "sampling_params.prompt_logprob_token_ids"),
    ("candidate = vocab", GEN, _gen(prompt_logprob_token_ids=[VOCAB]), 400, "sampling_params.prompt_logprob_token_ids"),
    ("pad below -1", GEN, _gen(prompt_logprob_token_ids=[[-2]] * _ROWS), 400,
     "sampling_params.prompt_logprob_token_ids"),
    # a header of [rows, 2] over the data of [rows, 3]: read as the header says, rows would be misaligned
    ("npy data past its header's shape", GEN,
     _gen(prompt_logprob_token_ids=_npy_with_header_shape(np.arange(_ROWS * 3).reshape(_ROWS, 3), (_ROWS, 2))),
     400, "sampling_params.prompt_logprob_token_ids"),
    ("npy data short of its header's shape", GEN,
     _gen(prompt_logprob_token_ids=_npy_with_header_shape(np.arange(_ROWS * 2).reshape(_ROWS, 2), (_ROWS, 3))),
     400, "sampling_params.prompt_logprob_token_ids"),
    ("npy float ids", GEN, _gen(prompt_logprob_token_ids=npy_b64(np.ones((_ROWS, 2), np.float32))), 400,
     "sampling_params.prompt_logprob_token_ids"),
    # each of its parts within max_rows_x_k, the union's [rows, Kc + K] twice it
    ("union past max_rows_x_k", GEN, {"token_ids": list(range(MAX_LEN)), "sampling_params": {
        "prompt_logprob_token_ids": list(range(MAX_K)), "prompt_logprob_topk": MAX_K, "prompt_logprob_union": True}},
     400, "sampling_params.prompt_logprob_union"),
    ("negative start", GEN, _gen(prompt_logprob_token_ids=[1], prompt_logprob_start=-1), 400,
     "sampling_params.prompt_logprob_start"),
    ("temperature not a number", GEN, _gen(prompt_logprob_token_ids=[1], temperature="warm"), 400,
     "sampling_params.temperature"),
    ("unknown field", GEN, {**_gen(), "top_k_ids": [1]}, 400, "top_k_ids"),
    ("unknown model", GEN, {**_gen(), "model": "nope"}, 404, "model"),
    ("stream", GEN, {**_gen(), "stream": True}, 400, "stream"),
    ("prompt empty", COMP, {**_COMP, "prompt": []}, 400, "prompt"),
    ("an empty prompt in a batch", COMP, {**_COMP, "prompt": [IDS, []]}, 400, "prompt"),
    ("prompt id = vocab", COMP, {**_COMP, "prompt": [1, VOCAB]}, 400, "prompt"),
    ("prompt one over max_model_len", COMP, {**_COMP, "prompt": [1] * (MAX_LEN + 1)}, 400, "prompt"),
    ("prompt_logprobs > max_logprobs", COMP, {**_COMP, "prompt_logprobs": MAX_K + 1}, 400, "prompt_logprobs"),
    ("max_tokens 2", COMP, {**_COMP, "max_tokens": 2}, 400, "max_tokens"),
    ("n 2", COMP, {**_COMP, "n": 2}, 400, "n"),
    ("temperature a word", COMP, {**_COMP, "temperature": "warm"}, 400, "temperature"),
    ("temperature a list", COMP, {**_COMP, "temperature": [0.5]}, 400, "temperature"),
    ("temperature a bool", COMP, {**_COMP, "temperature": True}, 400, "temperature"),
    ("temperature negative", COMP, {**_COMP, "temperature": -1}, 400, "temperature"),
    # vLLM's sampling fields, which do not change the scores, type-checked as vLLM's model reads them
    ("top_p a word", COMP, {**_COMP, "top_p": "abc"}, 400, "top_p"),
    ("seed a word", COMP, {**_COMP, "seed": "x"}, 400, "seed"),
    ("seed past int64", COMP, {**_COMP, "seed": 2**63}, 400, "seed"),
    ("stop a number", COMP, {**_COMP, "stop": 5}, 400, "stop"),
    ("logit_bias a word", COMP, {**_COMP, "logit_bias": "x"}, 400, "logit_bias"),
    ("use_beam_search a word", COMP, {**_COMP, "use_beam_search": "x"}, 400, "use_beam_search"),
    ("unknown model", COMP, {**_COMP, "model": "nope"}, 404, "model"),
    # more prompts than the queue holds: a 400 (no retry helps), not a 429 after reading them all
    ("a batch past the queue", COMP, {**_COMP, "prompt": [[1, 2]] * (QUEUE + 1)}, 400, "prompt"),
    ("input_ids empty", SGL, {**_SGL, "input_ids": []}, 400, "input_ids"),
    ("input id = vocab", SGL, {**_SGL, "input_ids": [1, VOCAB]}, 400, "input_ids"),
    ("input_ids one over max_model_len", SGL, {**_SGL, "input_ids": [1] * (MAX_LEN + 1)}, 400, "input_ids"),
    ("top_logprobs_num > max_logprobs", SGL, {**_SGL, "top_logprobs_num": MAX_K + 1}, 400, "top_logprobs_num"),
    ("token_ids_logprob = vocab", SGL, {**_SGL, "token_ids_logprob": [VOCAB]}, 400, "token_ids_logprob"),
    ("a batch past the queue", SGL, {**_SGL, "input_ids": [[1, 2]] * (QUEUE + 1)}, 400, "input_ids"),
    ("logprob_start_len below -1", SGL, {**_SGL, "logprob_start_len": -2}, 400, "logprob_start_len"),
    ("max_new_tokens 2", SGL, {**_SGL, "sampling_params": {"max_new_tokens": 2}}, 400, "sampling_params.max_new_tokens"),
    ("temperature a word", SGL, {**_SGL, "sampling_params": {"max_new_tokens": 0, "temperature": "warm"}}, 400,
     "sampling_params.temperature"),
    ("temperature negative", SGL, {**_SGL, "sampling_params": {"max_new_tokens": 0, "temperature": -0.5}}, 400,
     "sampling_params.temperature"),
    ("temperature negative", GEN, _gen(prompt_logprob_token_ids=[1], temperature=-1), 400,
     "sampling_params.temperature"),
    # a value of the wrong type is refused, never converted (true is not 1, "1" is not 1)
    ("prompt_logprob_temperature a bool", GEN, _gen(prompt_logprob_token_ids=[1], prompt_logprob_temperature=True),
     400, "sampling_params.prompt_logprob_temperature"),
    ("prompt_logprob_temperature a string", GEN, _gen(prompt_logprob_token_ids=[1], prompt_logprob_temperature="0.5"),
     400, "sampling_params.prompt_logprob_temperature"),
    ("temperature a bool", GEN, _gen(prompt_logprob_token_ids=[1], temperature=True), 400, "sampling_params.temperature"),
    ("n a bool", GEN, _gen(n=True), 400, "sampling_params.n"),
    ("n a string", GEN, _gen(n="1"), 400, "sampling_params.n"),
    ("n 1.5", GEN, _gen(n=1.5), 400, "sampling_params.n"),
    ("n a bool", SGL, {**_SGL, "sampling_params": {"max_new_tokens": 0, "n": True}}, 400, "sampling_params.n"),
    ("n 1.5", SGL, {**_SGL, "sampling_params": {"max_new_tokens": 0, "n": 1.5}}, 400, "sampling_params.n"),
    # ids are checked whether or not the request ends up scoring them
    ("logprob_token_ids id = vocab, nothing generated", COMP,
     {**_COMP, "logprobs": 1, "return_tokens_as_token_ids": True, "logprob_token_ids": [VOCAB]}, 400,
     "logprob_token_ids"),
    ("token_ids_logprob id = vocab, no logprobs asked", SGL, {**_SGL, "return_logprob": False,
                                                               "token_ids_logprob": [VOCAB]}, 400, "token_ids_logprob"),
    ("suffix", COMP, {**_COMP, "suffix": "x"}, 400, "suffix"),
    ("truncate_prompt_tokens 0", COMP, {**_COMP, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens past max_model_len", COMP, {**_COMP, "truncate_prompt_tokens": MAX_LEN + 1}, 400,
     "truncate_prompt_tokens"),
]


@pytest.mark.parametrize(("path", "payload", "status", "param"), [b[1:] for b in BAD],
                         ids=[f"{b[1]} {b[0]}" for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(server, path: str, payload: dict, status: int, param: str) -> None:
    assert_error(server.c.post(path, json=payload), status, param)


@pytest.mark.parametrize(("path", "payload", "param", "message"), [
    (COMP, {**_COMP, "prompt": [1, VOCAB]}, "prompt", f"prompt: id {VOCAB} is outside"),
    (COMP, {**_COMP, "prompt": [1] * (MAX_LEN + 1)}, "prompt", f"prompt has {MAX_LEN + 1} tokens"),
    (SGL, {**_SGL, "input_ids": [1, VOCAB]}, "input_ids", f"input_ids: id {VOCAB} is outside"),
    (SGL, {**_SGL, "token_ids_logprob": [1, VOCAB]}, "token_ids_logprob", f"token_ids_logprob: id {VOCAB}"),
    (COMP, {**_COMP, "temperature": "token_ids"}, "temperature", "got 'token_ids'")])  # (the client's value as sent)
def test_a_trainers_endpoint_names_its_own_fields_in_the_message(server, path: str, payload: dict, param: str,
                                                                  message: str) -> None:
    """The message names the field as the caller sent it, not the native request's name."""
    err = assert_error(server.c.post(path, json=payload), 400, param, contains=message)
    assert "sampling_params.prompt_logprob" not in err["message"] and "token_ids:" not in err["message"]


def test_n_of_one_written_as_a_float_is_one(server) -> None:
    """vLLM and SGLang read n: 1.0 as 1: accepted on all three endpoints, the same answer as n: 1."""
    c = server.c
    gen = [c.post(GEN, json=_gen(prompt_logprob_token_ids=[1], n=n)) for n in (1, 1.0)]
    sgl = [c.post(SGL, json={**_SGL, "sampling_params": {"max_new_tokens": 0, "n": n}}) for n in (1, 1.0)]
    comp = [c.post(COMP, json={**_COMP, "n": n}) for n in (1, 1.0)]
    for r in gen + sgl + comp:
        assert r.status_code == 200, r.text
    assert comp[0].json()["choices"][0]["prompt_logprobs"] == comp[1].json()["choices"][0]["prompt_logprobs"]
    assert gen[0].json()["prompt_token_id_logprobs"] == gen[1].json()["prompt_token_id_logprobs"]
    assert sgl[0].json()["meta_info"]["input_token_logprobs"] == sgl[1].json()["meta_info"]["input_token_logprobs"]


def test_truncate_prompt_tokens_scores_the_last_tokens(server) -> None:
    """vLLM's truncate_prompt_tokens on /v1/completions: the prompt's last k tokens are scored
    (the first k with truncation_side right), as that part sent alone is; -1 keeps
    max_model_len - max_tokens, also the most k may be."""
    c, long = server.c, np.random.default_rng(1).integers(0, VOCAB, MAX_LEN + 5).tolist()

    def plp(**kw) -> tuple[int, list]:
        r = c.post(COMP, json={**_COMP, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["prompt_logprobs"]

    assert plp(prompt=long, truncate_prompt_tokens=6) == plp(prompt=long[-6:]) and plp(prompt=long[-6:])[0] == 6
    assert plp(prompt=long, truncate_prompt_tokens=6, truncation_side="right") == plp(prompt=long[:6])
    assert plp(prompt=long[:5], truncate_prompt_tokens=6) == plp(prompt=long[:5])  # shorter: whole
    assert plp(prompt=long, truncate_prompt_tokens=-1) == plp(prompt=long[-MAX_LEN:])  # max_tokens 0: all of it
    assert plp(prompt=long, truncate_prompt_tokens=-1, max_tokens=1) == plp(prompt=long[-(MAX_LEN - 1):], max_tokens=1)
    assert_error(c.post(COMP, json={**_COMP, "prompt": long, "truncate_prompt_tokens": MAX_LEN, "max_tokens": 1}),
                 400, "truncate_prompt_tokens", contains=f"max_model_len - max_tokens = {MAX_LEN - 1}")


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"null", b'"x"', b'{"token_ids": [1, NaN]}',
                                 b'{"token_ids": [1, Infinity]}'])
@pytest.mark.parametrize("path", [GEN, COMP, SGL])
def test_a_body_that_is_not_a_json_object_is_a_400(server, path: str, raw: bytes) -> None:
    assert_error(server.c.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)


@pytest.mark.parametrize(("path", "payload", "param"), [
    (GEN, {"token_ids": [1, 2**63]}, "token_ids"),
    (GEN, _gen(prompt_logprob_token_ids=[[1]] * (_ROWS - 1) + [[2**64 - 1]]), "sampling_params.prompt_logprob_token_ids"),
    (COMP, {**_COMP, "prompt": [1, 2**63]}, "prompt")])
def test_an_id_past_int64_is_named(server, path: str, payload: dict, param: str) -> None:
    """Integers all, one beyond int64: the 400 names that id (not the float dtype numpy makes of them)."""
    big = next(x for x in json.dumps(payload).replace("[", " ").replace("]", " ").replace(",", " ").split()
               if x.lstrip("-").isdigit() and abs(int(x)) >= 2**63)
    assert_error(server.c.post(path, json=payload), 400, param, contains=f"id {big} is out of range")


def test_request_timeout_header_out_of_range_says_the_range(server) -> None:
    r = server.c.post(GEN, json=_gen(prompt_logprob_token_ids=[1]), headers={"X-Request-Timeout": "1e10"})
    assert_error(r, 400, "x-request-timeout", contains="below 1e9")


def test_lengths_at_the_boundaries(server) -> None:
    """Exactly max_model_len, a single token and prompt-only requests are served, with every
    row there and none made up, on each endpoint."""
    c = server.c
    ids = np.random.default_rng(0).integers(0, VOCAB, MAX_LEN).tolist()
    r = c.post(GEN, json={"token_ids": ids, "sampling_params": {"prompt_logprob_token_ids": [1, 2],
                                                                "prompt_logprob_topk": MAX_K}})
    assert r.status_code == 200, r.text
    assert decode(r.json()["prompt_token_id_logprobs"]).shape == (MAX_LEN - 1, 2)
    assert decode(r.json()["prompt_topk_logprobs"]).shape == (MAX_LEN - 1, MAX_K)
    half = MAX_K // 2  # a union of exactly max_rows_x_k values
    r = c.post(GEN, json={"token_ids": ids, "sampling_params": {"prompt_logprob_token_ids": list(range(half)),
                                                                "prompt_logprob_topk": half, "prompt_logprob_union": True}})
    assert r.status_code == 200, r.text
    assert decode(r.json()["prompt_union_logprobs"]).shape == (MAX_LEN - 1, MAX_K)
    plp = c.post(COMP, json={**_COMP, "prompt": ids, "max_tokens": 1}).json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == MAX_LEN and plp[0] is None and all(len(e) >= 1 for e in plp[1:])
    meta = c.post(SGL, json={**_SGL, "input_ids": ids}).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == MAX_LEN

    for start in (len(IDS) - 1, len(IDS), len(IDS) + 5):  # prompt only: zero rows, never null
        r = c.post(GEN, json=_gen(prompt_logprob_token_ids=[1, 2, 3], prompt_logprob_start=start,
                                  prompt_logprob_actual=True))
        assert r.status_code == 200, r.text
        assert decode(r.json()["prompt_token_id_logprobs"]).shape == (0, 3)
        assert decode(r.json()["prompt_actual_logprobs"]).shape == (0,)
    full = [[1, 2, 3]] * QUEUE  # a batch the queue holds exactly
    assert len(c.post(COMP, json={**_COMP, "prompt": full}).json()["choices"]) == QUEUE
    assert len(c.post(SGL, json={**_SGL, "input_ids": full}).json()) == QUEUE
    one = c.post(GEN, json={"token_ids": [7], "sampling_params": {"prompt_logprob_token_ids": [1, 2]}}).json()
    assert decode(one["prompt_token_id_logprobs"]).shape == (0, 2) and len(one["choices"][0]["token_ids"]) == 1
    assert c.post(COMP, json={**_COMP, "prompt": [7]}).json()["choices"][0]["prompt_logprobs"] == [None]
    assert c.post(SGL, json={**_SGL, "input_ids": [7]}).json()["meta_info"]["input_token_logprobs"] == [[None, 7, None]]


def _completion_row(c, **extra) -> dict:
    r = c.post(COMP, json={**_COMP, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_logprobs"][3]


def _sglang_row(c, temperature) -> list:
    r = c.post(SGL, json={**_SGL, "sampling_params": {"max_new_tokens": 0, "temperature": temperature}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["input_token_logprobs"][3]


def test_a_temperature_sent_as_a_string_scales_as_the_number(server) -> None:
    """vLLM's request models read "0.5" as 0.5; in processed_logprobs mode it must scale the
    scores as 0.5 does, never leave them unscaled without a word."""
    c = server.c
    plain, half = _completion_row(c), _completion_row(c, temperature=0.5)
    assert plain != half  # (the mode is on: the temperature matters)
    assert _completion_row(c, temperature="0.5") == half
    assert _sglang_row(c, "0.5") == _sglang_row(c, 0.5) != _sglang_row(c, None)


def test_vllms_sampling_fields_of_the_right_type_leave_the_scores_alone(server) -> None:
    """What vLLM's request model takes (a number as a string too) is taken, and changes nothing."""
    c = server.c
    assert _completion_row(c, top_p="0.9", seed=7, stop=["x"], logit_bias={"5": 1}, use_beam_search=False,
                           stop_token_ids=[2], min_tokens=0, user="u") == _completion_row(c)


def test_still_serving_the_same_answers_after_the_bad_ones(server) -> None:
    body = _gen(prompt_logprob_token_ids=[[1, 2]] * _ROWS, prompt_logprob_topk=4)
    first = server.c.post(GEN, json=body).json()
    for _, path, payload, _, _ in BAD:
        server.c.post(path, json=payload)
    assert server.c.get("/health").json() == {"status": "ready"}
    again = server.c.post(GEN, json=body).json()
    for key in ("prompt_token_id_logprobs", "prompt_topk_token_ids", "prompt_topk_logprobs"):
        np.testing.assert_allclose(decode(again[key]), decode(first[key]), rtol=0, atol=1e-5)
