"""The HTTP contract (docs/api.md), over a real server and a real client:
every validation rule gets its 400/404 in vLLM's error shape, and the server still
answers correctly afterwards."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from apiutil import assert_error, body, decode, npy_b64, raw_http

GEN = "/inference/v1/generate"
TOKS = [5, 17, 99, 3, 250, 1000, 7, 42, 8, 1]
GOOD = body(TOKS, [[1, 2], [3, -1], [4, 5], [6, 7]], start=5)


@pytest.fixture(scope="module")
def client(demo_server):
    with demo_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def good_result(client):
    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200, r.text
    return decode(r.json()["prompt_token_id_logprobs"])


BAD = [
    ("empty token_ids", {"token_ids": []}, 400, "token_ids", None),
    ("missing token_ids", {"sampling_params": {}}, 400, "token_ids", "required"),
    ("float id", {"token_ids": [1, 2.5]}, 400, "token_ids", None),
    ("bool id", {"token_ids": [1, True]}, 400, "token_ids", None),
    ("string id", {"token_ids": [1, "2"]}, 400, "token_ids", None),
    ("huge id", {"token_ids": [1, 2 ** 70]}, 400, "token_ids", None),
    ("negative id", {"token_ids": [1, -3]}, 400, "token_ids", None),
    ("id >= vocab", {"token_ids": [1, 4096]}, 400, "token_ids", "outside"),
    ("stream", {"token_ids": [1, 2], "stream": True}, 400, "stream",
     "prompt_logprob_token_ids are not available when stream=true."),
    ("unknown sampling field", body(TOKS, bogus_field=1), 400, "sampling_params.bogus_field", "unknown field"),
    ("unknown top-level field", {"token_ids": [1, 2], "prompt": "hi"}, 400, "prompt", "unknown field"),
    ("unknown field beside vLLM's", {"token_ids": [1, 2], "kv_transfer_params": {}, "lora_request": {}}, 400,
     "lora_request", "unknown field"),
    ("max_tokens 2", body(TOKS, max_tokens=2), 400, "sampling_params.max_tokens", None),
    ("-1 in flat form", body(TOKS, [4, -1]), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("-2 in per-row", body(TOKS, [[1, -2], [2, 3]], start=7), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("cand >= vocab", body(TOKS, [[1, 4096], [2, 3]], start=7), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("K == 0 flat", body(TOKS, []), 400, "sampling_params.prompt_logprob_token_ids", "at least 1"),
    ("K == 0 rows", body(TOKS, [[], []], start=7), 400, "sampling_params.prompt_logprob_token_ids", None),
    # K == 0 is refused in every form, also with zero rows (`[]` is not "zero rows of unknown K")
    ("K == 0 flat, zero rows", body(TOKS, [], start=9), 400, "sampling_params.prompt_logprob_token_ids", "at least 1"),
    ("K == 0 npy [0]", body(TOKS, npy_b64(np.zeros(0, np.int32))), 400, "sampling_params.prompt_logprob_token_ids",
     "at least 1"),
    ("K == 0 npy [rows, 0]", body(TOKS, npy_b64(np.zeros((2, 0), np.int32)), start=7), 400,
     "sampling_params.prompt_logprob_token_ids", "at least 1"),
    ("K == 0 npy [0, 0]", body(TOKS, npy_b64(np.zeros((0, 0), np.int32)), start=9), 400,
     "sampling_params.prompt_logprob_token_ids", "at least 1"),
    ("K > max_logprobs", body(TOKS, list(range(65))), 400, "sampling_params.prompt_logprob_token_ids", "max_logprobs"),
    ("negative start", body(TOKS, [1, 2], start=-1), 400, "sampling_params.prompt_logprob_start", None),
    ("row count mismatch", body(TOKS, [[1, 2]] * 3, start=5), 400, "sampling_params.prompt_logprob_token_ids", "rows"),
    ("start without candidates", body(TOKS, start=3), 400, "sampling_params.prompt_logprob_start", None),
    ("ragged rows", body(TOKS, [[1, 2], [3]], start=7), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("mixed ids and rows", body(TOKS, [[1, 2], 3], start=7), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("invalid base64", body(TOKS, "%%%not-base64%%%"), 400, "sampling_params.prompt_logprob_token_ids", "base64"),
    ("not npy", body(TOKS, base64.b64encode(b"hello world").decode()), 400,
     "sampling_params.prompt_logprob_token_ids", None),
    ("npy float dtype", body(TOKS, npy_b64(np.array([1.0, 2.0]))), 400, "sampling_params.prompt_logprob_token_ids", "integer"),
    ("npy object dtype", body(TOKS, npy_b64(np.array([1, "x"], dtype=object))), 400,
     "sampling_params.prompt_logprob_token_ids", None),
    ("npy 3-D", body(TOKS, npy_b64(np.zeros((1, 2, 3), np.int32))), 400, "sampling_params.prompt_logprob_token_ids", None),
    ("npy wrong rows", body(TOKS, npy_b64(np.array([[1, 2]] * 3, np.int32)), start=5), 400,
     "sampling_params.prompt_logprob_token_ids", None),
    ("prompt_logprobs too large", body(TOKS, prompt_logprobs=65), 400, "sampling_params.prompt_logprobs", None),
    ("prompt_logprobs negative", body(TOKS, prompt_logprobs=-2), 400, "sampling_params.prompt_logprobs", None),
    ("truncate_prompt_tokens", body(TOKS, truncate_prompt_tokens=4), 400, "sampling_params.truncate_prompt_tokens", None),
    ("sampling_params not an object", {"token_ids": [1, 2], "sampling_params": "x"}, 400, "sampling_params", None),
    ("token_ids not a list", {"token_ids": "1 2 3"}, 400, "token_ids", None),
    ("too long", {"token_ids": [1] * 8193}, 400, "token_ids", "max_model_len"),
]


@pytest.mark.parametrize("name,payload,status,param,contains", BAD, ids=[b[0] for b in BAD])
def test_rejects(client, good_result, name, payload, status, param, contains) -> None:
    assert_error(client.post(GEN, json=payload), status, param, contains)
    # the server still answers, and correctly
    r = client.post(GEN, json=GOOD)
    assert r.status_code == 200
    assert_scores_close(decode(r.json()["prompt_token_id_logprobs"]), good_result)


def assert_scores_close(got: np.ndarray, want: np.ndarray) -> None:
    """Same scores within 1e-5 (float32 on CPU; -inf where the other has -inf): requests that
    differ in batch company or cache hits run other shapes, and only deterministic mode
    promises the same bits."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_unknown_model_is_404(client) -> None:
    assert_error(client.post(GEN, json={**GOOD, "model": "no-such-model"}), 404, "model")
    served = client.get("/v1/models").json()["data"][0]["id"]
    assert client.post(GEN, json={**GOOD, "model": served}).status_code == 200


def test_invalid_json_and_non_object(client) -> None:
    assert_error(client.post(GEN, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(client.post(GEN, json=[1, 2, 3]), 400)
    assert_error(client.post(GEN, content=b"", headers={"content-type": "application/json"}), 400)


def test_never_422(client) -> None:
    for payload in ({}, {"token_ids": None}, {"token_ids": [[1]]}, {"token_ids": [1], "priority": "high"}):
        assert client.post(GEN, json=payload).status_code == 400


def test_candidate_forms_agree(client) -> None:
    """Flat list, per-row list, and base64 .npy (int32 and int64, [K] and [rows, K])."""
    toks = list(range(100, 140))
    start = 30
    rows = len(toks) - 1 - start
    flat = [7, 8, 9, 10]
    per_row = [flat] * rows
    outs = []
    for cands in (flat, per_row, npy_b64(np.array(flat, np.int32)), npy_b64(np.array(per_row, np.int64))):
        r = client.post(GEN, json=body(toks, cands, start=start))
        assert r.status_code == 200, r.text
        outs.append(decode(r.json()["prompt_token_id_logprobs"]))
    for o in outs:
        assert o.shape == (rows, 4) and o.dtype == np.float32
        assert_scores_close(o, outs[0])


@pytest.mark.parametrize("start", [9, 10, 50])
def test_zero_rows_is_empty_matrix(client, start) -> None:
    r = client.post(GEN, json=body(TOKS, [1, 2, 3], start=start))
    assert r.status_code == 200
    m = decode(r.json()["prompt_token_id_logprobs"])
    assert m.shape == (0, 3) and m.dtype == np.float32
    r = client.post(GEN, json=body(TOKS, npy_b64(np.zeros((0, 3), np.int32)), start=start))  # per-row, zero rows
    assert r.status_code == 200
    assert decode(r.json()["prompt_token_id_logprobs"]).shape == (0, 3)


def test_padding_scores_minus_inf(client, good_result) -> None:
    assert good_result.shape == (4, 2)
    assert good_result[1, 1] == -np.inf
    assert np.isfinite(np.delete(good_result.ravel(), 3)).all()
    assert (good_result < 0).all()


def test_response_fields(client) -> None:
    r = client.post(GEN, json={**GOOD, "request_id": "abc-1", "return_token_ids": True,
                               "cache_salt": "tenant-a", "priority": 3},
                    headers={"Authorization": "Bearer EMPTY"})
    assert r.status_code == 200
    j = r.json()
    assert j["request_id"] == "abc-1"
    assert j["prompt_token_ids"] == TOKS
    assert isinstance(j["created"], int) and j["model"]
    assert j["choices"][0]["index"] == 0 and len(j["choices"][0]["token_ids"]) == 1
    assert j["choices"][0]["logprobs"] is None and j["choices"][0]["finish_reason"]
    u = j["usage"]
    assert u["prompt_tokens"] == len(TOKS) and u["completion_tokens"] == 1 and u["total_tokens"] == len(TOKS) + 1
    assert u["prompt_tokens_details"]["cached_tokens"] >= 0
    assert j["prompt_logprobs"] is None
    # a generated request_id when absent, no prompt_token_ids unless asked
    j2 = client.post(GEN, json=body(TOKS, max_tokens=0)).json()
    assert j2["request_id"] and "prompt_token_ids" not in j2
    assert j2["choices"][0]["token_ids"] == [] and j2["usage"]["completion_tokens"] == 0
    assert j2["prompt_token_id_logprobs"] is None


def test_sampling_fields_do_not_change_scores(client, good_result) -> None:
    sp = dict(GOOD["sampling_params"], temperature=0.7, top_p=0.9, top_k=50, seed=3, stop=["x"],
              skip_special_tokens=True, repetition_penalty=1.1, n=1, logprobs=1)
    r = client.post(GEN, json={**GOOD, "sampling_params": sp})
    assert r.status_code == 200
    assert_scores_close(decode(r.json()["prompt_token_id_logprobs"]), good_result)


def test_prompt_logprobs_layout(client) -> None:
    r = client.post(GEN, json=body(TOKS, [[t] for t in TOKS[5:]], start=4, prompt_logprobs=3))
    j = r.json()
    plp = j["prompt_logprobs"]
    assert len(plp) == len(TOKS) and plp[0] is None
    m = decode(j["prompt_token_id_logprobs"])
    for pos in range(1, len(TOKS)):
        entry = plp[pos]
        first_key = next(iter(entry))
        assert first_key == str(TOKS[pos])  # the actual token is the first key
        assert 3 <= len(entry) <= 4
        ranks = [v["rank"] for k, v in entry.items() if k != first_key]
        assert ranks == sorted(ranks)
        if pos >= 5:  # per-row K=1 candidates are the actual tokens: both must agree
            assert abs(entry[first_key]["logprob"] - float(m[pos - 5, 0])) < 1e-6


def test_other_endpoints(client) -> None:
    assert client.get("/health").status_code == 200
    head = client.head("/health")  # (load balancers' probes that send HEAD)
    assert head.status_code == 200 and not head.content
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 8192
    spec = client.get("/openapi.json").json()
    assert "/inference/v1/generate" in spec["paths"]
    assert "GenerateRequest" in spec["components"]["schemas"]
    assert client.get("/metrics").status_code == 200
    missing = client.get("/no-such-path", headers={"X-Request-Id": "trace-404"})
    assert_error(missing, 404)
    assert missing.headers["X-Request-Id"] == "trace-404"
    import gzip
    import json

    packed = client.post(GEN, content=gzip.compress(json.dumps(body(TOKS, [[88, 90]] * 4, start=5)).encode()),
                         headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert_error(packed, 400, contains="Content-Encoding 'gzip' is not supported")
    wrong = client.get(GEN)
    assert_error(wrong, 405)
    assert wrong.headers["allow"] == "POST"  # a 405 names the methods that are allowed
    assert_error(client.post(GEN, json=body(TOKS, [[88, 90], [17, "x"]], start=5)), 400,
                 contains="prompt_logprob_token_ids.1.1:")  # the bad element, not the flat branch's row 0
    for rows, where in [([[88, 90], "x"], "1: Input should be a valid list"),  # a row that is not a list
                        ([[88, 90], 5], "1: Input should be a valid list"),
                        ([88, "x"], "1: Input should be a valid integer")]:  # a flat list's bad id
        assert_error(client.post(GEN, json=body(TOKS, rows, start=5)), 400,
                     contains=f"prompt_logprob_token_ids.{where}")


def test_uint64_ids_never_wrap(client) -> None:
    """2**64 - 1 would wrap to -1 (padding) in int64: it must be refused instead."""
    assert_error(client.post(GEN, json=body(TOKS, [[2 ** 64 - 1, 1]] * 4, start=5)), 400)
    arr = np.array([[2 ** 64 - 1, 1]] * 4, dtype=np.uint64)
    assert_error(client.post(GEN, json=body(TOKS, npy_b64(arr), start=5)), 400)


def test_empty_cache_salt_is_rejected(client) -> None:
    assert_error(client.post(GEN, json={**GOOD, "cache_salt": ""}), 400, "cache_salt")


def test_large_body_parsed_off_the_loop(client, good_result) -> None:
    """A body above the inline threshold (parsed in a worker thread) gives the same answer."""
    big = {**GOOD, "request_id": "x" * 300_000}
    r = client.post(GEN, json=big)
    assert r.status_code == 200 and r.json()["request_id"] == big["request_id"]
    assert_scores_close(decode(r.json()["prompt_token_id_logprobs"]), good_result)
    assert_error(client.post(GEN, json={**big, "model": "nope"}), 404, "model")


def test_large_bodies_use_one_io_thread(client, monkeypatch) -> None:
    """Concurrent large bodies are parsed on the server's single io thread, not on a pool of
    threads that would compete with the engine thread for the GIL."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from teacher_server.server import parsing

    names: list[str] = []
    orig = parsing.parse_request

    def spy(*a):
        names.append(threading.current_thread().name)
        return orig(*a)

    monkeypatch.setattr(parsing, "parse_request", spy)
    big = {**GOOD, "request_id": "y" * 300_000}
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda i: client.post(GEN, json={**big, "request_id": f"{i}" * 300_000}).status_code,
                              range(6)))
    assert codes == [200] * 6
    assert len(names) == 6 and len(set(names)) == 1 and names[0].startswith("teacher-io"), names


def test_duplicate_candidates_are_scored_like_any_column(client) -> None:
    """A trainer appending the sampled token to the student's top-K may repeat an id."""
    toks = list(range(200, 230))
    start, rows = 20, 9
    uniq = client.post(GEN, json=body(toks, [7, 8, 9], start=start)).json()
    flat = client.post(GEN, json=body(toks, [7, 8, 7, 9, 9], start=start))
    assert flat.status_code == 200, flat.text
    u, f = decode(uniq["prompt_token_id_logprobs"]), decode(flat.json()["prompt_token_id_logprobs"])
    np.testing.assert_allclose(f, u[:, [0, 1, 0, 2, 2]], rtol=0, atol=1e-5)
    per_row = [[7, 7, 8], [9, 8, 9]] + [[7, 8, 9]] * (rows - 2)
    r = client.post(GEN, json=body(toks, per_row, start=start))
    assert r.status_code == 200, r.text
    m = decode(r.json()["prompt_token_id_logprobs"])
    np.testing.assert_allclose(m[0], u[0, [0, 0, 1]], rtol=0, atol=1e-5)
    np.testing.assert_allclose(m[1], u[1, [2, 1, 2]], rtol=0, atol=1e-5)


def test_vllm_generate_fields_are_accepted_and_ignored(client, good_result) -> None:
    extra = {"features": None, "kv_transfer_params": {"do_remote_prefill": False}, "stream_options": {
        "include_usage": True}, "assistant_tokens_mask": [1] * len(TOKS), "token_offsets": None}
    sp = dict(GOOD["sampling_params"], skip_reading_prefix_cache=True)
    r = client.post(GEN, json={**GOOD, **extra, "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert_scores_close(decode(r.json()["prompt_token_id_logprobs"]), good_result)


def test_x_request_id_is_read_and_echoed(client) -> None:
    r = client.post(GEN, json=GOOD, headers={"X-Request-Id": "trace-77"})
    assert r.status_code == 200 and r.json()["request_id"] == "trace-77"
    assert r.headers["x-request-id"] == "trace-77"
    r = client.post(GEN, json={**GOOD, "request_id": "body-1"}, headers={"X-Request-Id": "trace-78"})
    assert r.json()["request_id"] == "body-1" and r.headers["x-request-id"] == "body-1"  # the body's id wins
    r = client.post(GEN, json=GOOD)
    assert r.headers["x-request-id"] == r.json()["request_id"]  # a generated id is returned too
    r = client.post(GEN, json={**GOOD, "request_id": "two\nlines"})
    assert r.status_code == 200 and r.json()["request_id"] == "two\nlines"
    assert "\n" not in r.headers["x-request-id"]  # a header value stays one header
    bad = client.post(GEN, json={"token_ids": [], "request_id": "bad-9"}, headers={"X-Request-Id": "t"})
    assert_error(bad, 400)
    assert bad.headers["x-request-id"] == "bad-9"
    long = "run42/step7/" + "a" * 1000  # valid as a header: echoed whole, as sent
    r = client.post(GEN, json=GOOD, headers={"X-Request-Id": long})
    assert r.json()["request_id"] == long and r.headers["x-request-id"] == long
    huge = "é" * 5000  # neither: percent-encoded, cut at a whole character to 4096 bytes
    r = client.post(GEN, json={**GOOD, "request_id": huge})
    assert r.json()["request_id"] == huge
    echoed = r.headers["x-request-id"]
    assert len(echoed) <= 4096 and echoed == "%C3%A9" * (4096 // 6)
    r = client.post(GEN, json={**GOOD, "request_id": ""}, headers={"X-Request-Id": "t"})  # "" is an id, not absent
    assert r.status_code == 200 and r.json()["request_id"] == "" and r.headers["x-request-id"] == ""


def test_millions_of_wrong_values_are_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of wrongly typed values stops at the first: the 400 names it, and pydantic makes
    one error per union branch, not one per value (2 million of them took seconds and
    gigabytes of the front's memory)."""
    import json

    from teacher_server.server import parsing

    seen = []
    real = parsing.pydantic_message
    monkeypatch.setattr(parsing, "pydantic_message", lambda errors: seen.append(len(errors)) or real(errors))
    limits = parsing.Limits(vocab_size=4096, max_model_len=1 << 20, max_logprobs=256, max_rows_x_k=10**8)
    for req, where in (({"token_ids": [1, 2], "sampling_params": {"prompt_logprob_token_ids": [[1.5] * 64] * 2000}},
                         "sampling_params.prompt_logprob_token_ids.0.0"),
                        ({"token_ids": [1, 2] + ["x"] * 100_000}, "token_ids.2"),
                        ({"token_ids": [1], "sampling_params": {"allowed_token_ids": ["a"] * 100_000}},
                         "sampling_params.allowed_token_ids.0"),
                        ({"token_ids": [1], "sampling_params": {"logit_bias": {str(i): "x" for i in range(100_000)}}},
                         "sampling_params.logit_bias.0")):
        with pytest.raises(parsing.BadRequest) as e:
            parsing.parse_request(json.dumps(req).encode(), limits, "m")
        assert e.value.status == 400 and str(e.value).startswith(where), str(e.value)
    assert seen and max(seen) <= 3, seen


def test_prompt_logprobs_output_is_capped(tmp_path_factory) -> None:
    from conftest import LiveServer

    from teacher_server.config import Config

    cfg = Config(demo_model_dir=str(tmp_path_factory.mktemp("demo") / "m"), device="cpu", max_num_batched_tokens=512,
                 num_kv_blocks=1024, max_model_len=4096, max_logprobs=64, max_prompt_logprobs_entries=1000)
    with LiveServer(cfg) as s, s.client() as c:
        ok = c.post(GEN, json=body(range(1, 101), prompt_logprobs=9))  # 99 * 10 = 990 entries
        assert ok.status_code == 200 and len(ok.json()["prompt_logprobs"]) == 100
        assert_error(c.post(GEN, json=body(range(1, 101), prompt_logprobs=10)), 400,  # 99 * 11 entries
                     "sampling_params.prompt_logprobs", "max_prompt_logprobs_entries")
        assert c.post(GEN, json=body(range(1, 1001), [1, 2], start=900)).status_code == 200  # candidates: no cap


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n",
                                 b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                                 b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                 b"Content-Length: 4\r\n\r\nabcd",
                                 # both framings (how requests are smuggled): refused, not read by the first
                                 b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\nContent-Length: 999999999999\r\n\r\n"
                                 b"13\r\n{\"token_ids\":[1,2]}\r\n0\r\n\r\n"],
                         ids=["request line", "negative length", "two lengths", "two framings"])
def test_a_request_http_cannot_frame_gets_the_json_error(demo_server, raw: bytes) -> None:
    """Below the app (h11 refuses the framing, or OneFraming two framings) the 400 still has
    the documented shape, and the connection closes."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", demo_server.port), timeout=60) as sock:
        sock.sendall(raw)
        got = b""
        while chunk := sock.recv(65536):  # the server closes the connection after it
            got += chunk
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"content-type: application/json" in head.lower()
    err = json.loads(payload)["error"]
    assert err["code"] == 400 and "invalid HTTP request" in err["message"] and set(err) == {"message", "type",
                                                                                           "param", "code"}


def test_a_bad_chunk_gets_the_json_error_with_the_request_id(demo_server) -> None:
    """The headers were framed, the body's chunks were not: the 400 still names the request
    its headers named (every response carries X-Request-Id)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", demo_server.port), timeout=60) as sock:
        sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: chunky-1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"\r\nx-request-id: chunky-1" in head.lower(), head
    assert json.loads(payload)["error"]["code"] == 400


def test_a_bad_chunk_after_the_answer_closes_the_connection_quietly(demo_server, caplog) -> None:
    """The app may answer before reading the body (here: a compressed body is refused); a
    malformed chunk after that answer closes the connection without a second answer (and
    without the protocol failing on one)."""
    import socket

    with socket.create_connection(("127.0.0.1", demo_server.port), timeout=60) as sock:
        sock.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n")
        got = b""
        while b"}}" not in got:  # the whole JSON error
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        sock.sendall(b"zz\r\nnot a chunk\r\n")
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 400") and got.count(b"HTTP/1.1 ") == 1, got
    assert b"Content-Encoding 'gzip' is not supported" in got
    assert not [r for r in caplog.records if "data_received" in r.getMessage() or "LocalProtocolError" in r.getMessage()]


def test_candidates_reach_the_engine_as_int32_checked_first_in_int64() -> None:
    """Every accepted form becomes int32 (half the bytes carried to the engine's process); an
    id that int32 would wrap (2**32 + 5 reads as 5) is refused by the range check before it."""
    from teacher_server.validation import BadRequest, Limits, parse_candidates

    limits = Limits(vocab_size=4096, max_model_len=64, max_logprobs=16, max_rows_x_k=10**6)
    for value in ([7, 8, 4095], [[7, -1], [4095, 0]], npy_b64(np.array([[7, -1], [4095, 0]], np.int64)),
                  np.array([1, 2], np.uint16)):
        arr = parse_candidates(value, 2, limits, "c")
        assert arr.dtype == np.int32 and arr.flags.c_contiguous
        assert arr.tolist() in ([7, 8, 4095], [[7, -1], [4095, 0]], [1, 2])
    for value in ([[2**32 + 5, 1], [1, 1]], npy_b64(np.array([[1, 1], [2**32 + 5, 1]], np.int64))):
        with pytest.raises(BadRequest, match="outside"):
            parse_candidates(value, 2, limits, "c")


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, ">i4", np.int64, np.uint16, np.uint32, np.uint64])
def test_binary_candidates_are_range_checked_in_the_dtype_sent(dtype) -> None:
    """Signed binary ids are compared as sent (no widened copy), unsigned ones in int64: every
    dtype gives the same int32 array, and an id below -1 or at the vocab size is refused."""
    from teacher_server.validation import BadRequest, Limits, parse_candidates

    limits = Limits(vocab_size=100, max_model_len=64, max_logprobs=16, max_rows_x_k=10**6)
    signed = np.dtype(dtype).kind == "i"
    ok = [[7, -1], [99, 0]] if signed else [[7, 1], [99, 0]]
    arr = parse_candidates(npy_b64(np.array(ok, dtype)), 2, limits, "c")
    assert arr.dtype == np.int32 and arr.flags.c_contiguous and arr.tolist() == ok
    bad = [[100, 1], [1, -2] if signed else [1, np.iinfo(dtype).max]]
    for row in bad:
        with pytest.raises(BadRequest, match="outside|out of range"):
            parse_candidates(npy_b64(np.array([row, [1, 1]], dtype)), 2, limits, "c")


def test_a_coding_on_a_second_content_encoding_line_is_read(client) -> None:
    """``identity`` then ``gzip`` on two lines is the list ``identity, gzip``: refused as on one
    line (only the first line had been read, and the body taken as plain JSON)."""
    headers = [("Content-Type", "application/json"), ("Content-Encoding", "identity"), ("Content-Encoding", "gzip")]
    assert_error(client.post(GEN, content=json.dumps(GOOD).encode(), headers=headers), 400,
                 contains="Content-Encoding 'gzip' is not supported")
    both = [("Content-Type", "application/json"), ("Content-Encoding", "identity"), ("Content-Encoding", "Identity")]
    assert client.post(GEN, content=json.dumps(GOOD).encode(), headers=both).status_code == 200


def test_an_error_names_a_long_field_without_echoing_it_whole(client) -> None:
    """``param`` names the field a body got wrong, capped as ``message`` is (a 1 MB unknown key
    had come back whole)."""
    got = client.post(GEN, json={**GOOD, "x" * 100_000: 1})
    assert_error(got, 400, contains="unknown field")
    err = got.json()["error"]
    assert len(err["param"]) <= 200 and len(err["message"]) <= 500 and len(got.content) < 2000


def test_the_openapi_page_says_what_the_server_does(client) -> None:
    """An empty ``token_ids`` is a 400, so the schema asks for one id at least; ``/metrics``
    answers Prometheus' text format, not JSON (schemathesis found both)."""
    spec = client.get("/openapi.json").json()
    assert spec["components"]["schemas"]["GenerateRequest"]["properties"]["token_ids"]["minItems"] == 1
    assert_error(client.post(GEN, json={"token_ids": []}), 400, "token_ids")
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_a_request_refused_for_two_framings_keeps_its_request_id(demo_server) -> None:
    """The two-framings 400 names the request by the X-Request-Id its headers gave, as the other
    framing errors after the headers do (it had been one of ours)."""
    got = raw_http(demo_server.port, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Request-Id: mine-7\r\n"
                   b"Transfer-Encoding: chunked\r\nContent-Length: 19\r\n\r\n13\r\n{\"token_ids\":[1,2]}\r\n0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400") and b"\r\nx-request-id: mine-7\r\n" in got.lower(), got
