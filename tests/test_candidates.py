"""One rule for candidates (``teacher_server.candidates``): the server's validation, the HTTP
front, the in-process ``LLM`` and the client accept and refuse the same values."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from teacher_server import LLM
from teacher_server.client import TeacherClient, TeacherServerError
from teacher_server.server.parsing import parse_request
from teacher_server.server.responses import encode_npy, error_body
from teacher_server.validation import BadRequest, parse_candidates

PARAM = "sampling_params.prompt_logprob_token_ids"
TOKS, START, ROWS = list(range(1, 11)), 5, 4  # 4 scored rows
MAX_K, MAX_ROWS_X_K = 8, 24  # K of 7 or 8 is within max_logprobs, not within rows * K

GOOD = {
    "flat": [3, 7, 11],
    "flat tuple": (3, 7),
    "rows": [[1, 2], [3, 4], [5, 6], [7, 8]],
    "rows padded": [[1, -1], [3, 4], [-1, -1], [7, 8]],
    "rows of arrays": [np.array([1, 2]), np.array([3, 4]), np.array([5, 6]), np.array([7, 8])],
    "int32 [K]": np.array([3, 511], np.int32),
    "uint16 [K]": np.array([3, 7], np.uint16),
    "int64 [rows, K]": np.array([[1, -1]] * ROWS, np.int64),
    "rows*K at the limit": [list(range(6))] * ROWS,
}
BAD = {
    "K == 0 flat": [],
    "K == 0 rows": [[]] * ROWS,
    "K == 0 [rows, 0]": np.zeros((ROWS, 0), np.int32),
    "K == 0 [0]": np.zeros(0, np.int64),
    "ragged rows": [[1, 2], [3], [4, 5], [6, 7]],
    "ids and rows": [[1, 2], 3, [4, 5], [6, 7]],
    "float ids": [1.5, 2.0],
    "float array": np.array([1.0, 2.0]),
    "bool array": np.array([True, False]),
    "string array": np.array(["1", "2"]),
    "3-D": np.zeros((ROWS, 2, 1), np.int32),
    "-1 in [K]": [4, -1],
    "-2 in rows": [[1, -2], [3, 4], [5, 6], [7, 8]],
    "id at vocab": [1, 512],
    "id past int32": [2 ** 40],
    "uint64 max": np.array([[2 ** 64 - 1, 1]] * ROWS, np.uint64),
    "row count": [[1, 2]] * (ROWS - 1),
    "K over max_logprobs": list(range(MAX_K + 1)),
    "rows*K over the limit": [list(range(7))] * ROWS,
}


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["qwen3"]), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8,
               max_logprobs=MAX_K, max_rows_x_k=MAX_ROWS_X_K)


def validation_accepts(llm: LLM, cands: object) -> bool:
    try:
        parse_candidates(cands, ROWS, llm.limits, PARAM)
    except BadRequest as e:
        assert e.param == PARAM
        return False
    return True


def _front(llm: LLM, raw: bytes) -> httpx.Response:
    """The HTTP front's parsing and validation of a body; a 200 of zeros for one it accepts."""
    try:
        _, req = parse_request(raw, llm.limits, "m")
    except BadRequest as e:
        assert e.param == PARAM, e.message
        return httpx.Response(e.status, json=error_body(e.status, e.message, e.param))
    scores = np.zeros((ROWS, req.candidates.shape[-1]), np.float32)
    return httpx.Response(200, json={"prompt_token_id_logprobs": encode_npy(scores), "request_id": req.request_id})


def json_front_accepts(llm: LLM, cands: object) -> bool:
    body = {"token_ids": TOKS, "sampling_params": {"prompt_logprob_token_ids": cands, "prompt_logprob_start": START}}
    raw = json.dumps(body, default=lambda o: o.tolist()).encode()  # arrays as JSON lists
    return _front(llm, raw).status_code == 200


def llm_accepts(llm: LLM, cands: object) -> bool:
    try:
        out = llm.score(TOKS, cands, START)
    except ValueError as e:
        assert getattr(e, "param", None) == PARAM
        return False
    assert out.shape[0] == ROWS
    return True


def client_accepts(llm: LLM, cands: object) -> bool:
    """Refused before sending, or by the front its binary body reaches."""
    transport = httpx.MockTransport(lambda request: _front(llm, request.content))
    with TeacherClient("http://teacher.invalid", max_retries=0, transport=transport) as client:
        try:
            client.score(TOKS, cands, START)
        except (ValueError, TypeError):
            return False
        except TeacherServerError as e:
            assert e.status == 400 and e.param == PARAM, e
            return False
    return True


@pytest.mark.parametrize("name", [*GOOD, *BAD])
def test_every_caller_decides_alike(llm: LLM, name: str) -> None:
    cands, want = (GOOD[name], True) if name in GOOD else (BAD[name], False)
    got = {"validation": validation_accepts(llm, cands), "HTTP JSON": json_front_accepts(llm, cands),
           "LLM": llm_accepts(llm, cands), "client": client_accepts(llm, cands)}
    assert got == dict.fromkeys(got, want)
