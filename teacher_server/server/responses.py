"""Response bodies: vLLM's error shape, the base64 `.npy` matrix, and the generate response,
whose classic ``prompt_logprobs`` part is serialised in slices (bounded memory, and the GIL
is given up between slices so the engine thread and the event loop keep running)."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import time
import urllib.parse
from collections.abc import Callable

import numpy as np
import orjson
from fastapi.responses import Response

from teacher_server import b64
from teacher_server.engine.request import ScoreRequest, ScoreResult, prompt_logprob_entries
from teacher_server.server.byte_budget import Hold
from teacher_server.targets import union_columns

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowed", 408: "RequestTimeoutError", 409: "ConflictError",
               413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 429: "RateLimitError",
               499: "ClientClosedRequest",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}
NEG_INF_JSON = -9999.0  # JSON has no infinity; vLLM clients expect this value
PLP_SLICE = 512  # positions of prompt_logprobs serialised at a time (~ 512 * (k+1) entries)


HEADER_ID_MAX = 4096  # characters of a request id echoed in X-Request-Id (clients take 8-16 KB of headers)
HEADER_SAFE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")


def header_safe(rid: str) -> str:
    """A request id as a header value: as is when it is printable ASCII (no edge spaces) and at
    most ``HEADER_ID_MAX`` characters, else percent-encoded, cut to that length at a whole
    character (the body's ``request_id`` always has it whole)."""
    if len(rid) <= HEADER_ID_MAX and HEADER_SAFE.fullmatch(rid):
        return rid
    out, used = [], 0
    for ch in rid:
        q = urllib.parse.quote(ch, safe="")
        if used + len(q) > HEADER_ID_MAX:
            break
        out.append(q)
        used += len(q)
    return "".join(out)


def scope_request_id(scope: dict) -> str | None:
    """The X-Request-Id header of an ASGI request scope (as the server decoded it), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None


def request_id_header(rid: str | None) -> dict[str, str]:
    """The response's ``X-Request-Id`` for a request's id (none without one)."""
    return {"X-Request-Id": header_safe(rid)} if rid is not None else {}


def json_response(status: int, obj: dict) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    """``{"error": {message, type, param, code}}`` with ``status``."""
    return Response(orjson.dumps(error_body(status, message, param)), status_code=status,
                    media_type="application/json", headers=headers)


class HeldResponse(Response):
    """A JSON answer that holds its request's share of the in-flight byte budget (``hold``)
    until its body has been handed to the connection: sent in slices, each after the
    connection's write buffer has drained below uvicorn's high-water mark, so a client that
    reads slowly keeps its bytes counted instead of parked unseen in a buffer."""

    SLICE = 1 << 20

    def __init__(self, content: bytes, hold: Hold) -> None:
        super().__init__(content, media_type="application/json")
        self.hold = hold

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            view = memoryview(self.body)
            for i in range(0, len(view), self.SLICE):
                await send({"type": "http.response.body", "body": bytes(view[i:i + self.SLICE]), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.hold.release()


def encode_npy(arr: np.ndarray, dtype: str = "<f4") -> str:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr, dtype=dtype), allow_pickle=False)
    return b64.encode(buf.getbuffer())  # (a view of the buffer: no copy)


def finite_json(x: float) -> float:
    """x, or -9999.0 where it is -inf or NaN (JSON has no infinity), as vLLM writes prompt logprobs."""
    return NEG_INF_JSON if not math.isfinite(x) else x


def format_prompt_logprobs(req_tokens: np.ndarray, res: ScoreResult) -> list:
    """JSON form: ``{token id: {logprob, rank, decoded_token}}`` per entry, -inf as -9999.0."""
    return [None if e is None else {str(t): {"logprob": finite_json(v), "rank": r, "decoded_token": None}
                                    for t, v, r in e}
            for e in prompt_logprob_entries(req_tokens, res)]


def prompt_logprobs_json(req_tokens: np.ndarray, res: ScoreResult) -> bytes:
    """``format_prompt_logprobs`` as JSON bytes, built ``PLP_SLICE`` positions at a time: the
    Python objects of one slice exist at once (not the whole response's, ~0.5 KB per entry),
    and the thread sleeps between slices so other threads get the GIL."""
    n = len(req_tokens)
    parts = [b"[null"]
    for a in range(1, n, PLP_SLICE):
        b = min(a + PLP_SLICE, n)
        # entries a..b-1 read rows a-1..b-2 of the per-position arrays ([L-1] and [L-1, k])
        rows = slice(a - 1, b - 1)
        sub = dataclasses.replace(res, plp_token_logprob=res.plp_token_logprob[rows],
                                  plp_token_rank=res.plp_token_rank[rows], plp_topk_ids=res.plp_topk_ids[rows],
                                  plp_topk_logprobs=res.plp_topk_logprobs[rows])
        chunk = orjson.dumps(format_prompt_logprobs(req_tokens[a - 1:b], sub)[1:])
        parts.append(b"," + chunk[1:-1])
        time.sleep(0)  # let the engine thread and the event loop run
    parts.append(b"]")
    return b"".join(parts)


def row_target_fields(req: ScoreRequest, res: ScoreResult) -> dict[str, str]:
    """The asked row targets as base64 ``.npy`` members (ids int32, values float32)."""
    out = {}
    if req.top_k:
        out["prompt_topk_token_ids"] = encode_npy(res.topk_ids, "<i4")
        out["prompt_topk_logprobs"] = encode_npy(res.topk_logprobs)
    if req.union:
        ids, lps = union_columns(req.candidates, res.token_id_logprobs, res.topk_ids, res.topk_logprobs)
        out["prompt_union_token_ids"] = encode_npy(ids, "<i4")
        out["prompt_union_logprobs"] = encode_npy(lps)
    for key, arr in (("prompt_actual_logprobs", res.actual_logprobs), ("prompt_tail_logprobs", res.tail_logprobs),
                     ("prompt_logsumexp", res.logsumexp)):
        if arr is not None:
            out[key] = encode_npy(arr)
    return out


def generate_body(req: ScoreRequest, res: ScoreResult, model_name: str, return_token_ids: bool) -> bytes:
    """The JSON bytes of a successful generate response."""
    mt = req.max_tokens
    out = {
        "request_id": req.request_id,
        "model": model_name,
        "created": int(time.time()),
        "choices": [{"index": 0, "token_ids": [res.next_token] if mt and res.next_token is not None else [],
                     "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": req.length, "completion_tokens": mt, "total_tokens": req.length + mt,
                  "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
        "prompt_token_id_logprobs": encode_npy(res.token_id_logprobs) if res.token_id_logprobs is not None else None,
    }
    if return_token_ids:
        out["prompt_token_ids"] = req.token_ids.tolist()
    out.update(row_target_fields(req, res))
    if req.prompt_logprobs is None:
        out["prompt_logprobs"] = None
        return orjson.dumps(out)
    # the (large) prompt_logprobs list is spliced in as the last member
    return orjson.dumps(out)[:-1] + b',"prompt_logprobs":' + prompt_logprobs_json(req.token_ids, res) + b"}"
