"""The wire format of ``POST /inference/v1/generate`` as the clients speak it: requests,
candidates in binary form, decoded results and errors. numpy and httpx only (no torch); the
candidates' rules are ``teacher_server.candidates``, shared with the server and the in-process API."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from teacher_server import b64
from teacher_server.candidates import Candidates, candidate_ids, check_int32, integer_ids, is_whole
from teacher_server.npy import load_npy

GENERATE_PATH = "/inference/v1/generate"

try:  # the server's JSON codec where the client's environment has it: a W1f answer (~1 MB) parses in
    import orjson  # about half the standard library's time
    _loads = orjson.loads
except ImportError:  # a client-only install (numpy and httpx)
    _loads = json.loads


def loads(body: bytes) -> Any:
    """A response body's JSON (ValueError when it is not JSON)."""
    return _loads(body)


class TeacherServerError(Exception):
    """A request that failed for good.

    ``status`` is the HTTP status (None when no response came back, e.g. connection refused
    after every retry); ``type``, ``message``, ``param`` and ``code`` come from the server's
    ``{"error": {...}}`` body; ``attempts`` counts the requests sent.
    """

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: int | None = None, attempts: int = 1) -> None:
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.attempts = attempts
        where = f" (param: {param})" if param else ""
        head = f"{status} {type or 'error'}" if status is not None else (type or "error")
        super().__init__(f"{head}: {message}{where} [after {attempts} attempt(s)]")

    def __reduce__(self) -> tuple:  # (pickled across processes: made again from its parts, not its text)
        return _remade_error, (self.message, self.status, self.type, self.param, self.code, self.attempts)


def _remade_error(message: str, status: int | None, type: str | None, param: str | None, code: int | None,
                  attempts: int) -> TeacherServerError:
    return TeacherServerError(message, status=status, type=type, param=param, code=code, attempts=attempts)


@dataclass(frozen=True)
class Targets:
    """More of the scored rows than the candidates' log-probs, from the same prefill (the
    endpoint's ``prompt_logprob_topk`` ... ``prompt_logprob_temperature``; they come back in
    ``ScoreOutput``): ``topk`` the teacher's own top-K ids and log-probs; ``union`` the
    candidates' columns then the top-K ids not among them (-1 pads); ``actual`` the scored
    token's log-prob; ``tail`` the log of the mass outside the candidates and the top-K;
    ``logsumexp`` the log normalizer; ``temperature`` divides the logits before the softmax
    (vLLM's processed_logprobs) for every score of the request, the candidates' too."""

    topk: int | None = None
    union: bool = False
    actual: bool = False
    tail: bool = False
    logsumexp: bool = False
    temperature: float | None = None

    def fields(self) -> dict[str, Any]:
        """The sampling parameters that ask for them."""
        out: dict[str, Any] = {}
        if self.topk is not None:
            out["prompt_logprob_topk"] = _whole(self.topk, "targets.topk")
        for name in ("union", "actual", "tail", "logsumexp"):
            if getattr(self, name):
                out["prompt_logprob_" + name] = True
        if self.temperature is not None:
            t = self.temperature
            if isinstance(t, bool) or not isinstance(t, int | float | np.integer | np.floating):
                raise TypeError(f"targets.temperature must be a number, got {type(t).__name__} {t!r:.40}")
            out["prompt_logprob_temperature"] = float(t)
        return out


@dataclass(frozen=True)
class TeacherRequest:
    """One scoring request for ``score_batch``; the fields are ``score``'s arguments.

    ``score_batch`` also takes plain dicts with these keys, or tuples in this order.
    """

    token_ids: Sequence[int] | np.ndarray
    candidates: Candidates | None  # None: only ``targets`` are asked
    start: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 0
    priority: int = 0
    targets: Targets | None = None
    model: str | None = None  # the teacher to score with (a service of several); None: the client's ``model``


@dataclass(frozen=True)
class ScoreOutput:
    """A scored request: the matrix plus what the server reported about it."""

    scores: np.ndarray | None  # [rows, K] float32 teacher log-probs (logits in raw_logits mode); None: no candidates
    request_id: str
    model: str
    next_token: int | None  # greedy next token when max_tokens=1
    prompt_tokens: int
    cached_tokens: int  # tokens whose KV came from the prefix cache
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None  # vLLM's classic layout, when asked
    # the asked ``Targets`` (None otherwise), one entry per scored row
    topk_ids: np.ndarray | None = None  # [rows, K] int32, by rank
    topk_logprobs: np.ndarray | None = None  # [rows, K] float32
    union_ids: np.ndarray | None = None  # [rows, Kc + K] int32, -1 pads
    union_logprobs: np.ndarray | None = None  # [rows, Kc + K] float32, -inf at padding
    actual_logprobs: np.ndarray | None = None  # [rows] float32
    tail_logprobs: np.ndarray | None = None  # [rows] float32
    logsumexp: np.ndarray | None = None  # [rows] float32


RequestLike = TeacherRequest | Mapping[str, Any] | Sequence[Any]


def as_request(item: RequestLike) -> TeacherRequest:
    """A ``TeacherRequest`` from itself, a dict of its fields or a tuple in field order."""
    if isinstance(item, TeacherRequest):
        return item
    if isinstance(item, Mapping):
        return TeacherRequest(**item)
    return TeacherRequest(*item)


def candidates_array(candidates: Candidates) -> np.ndarray:
    """Candidates as an integer array of shape ``[K]`` (shared by every scored row) or
    ``[rows, K]`` (one row per scored position, ``-1`` pads), checked before anything is sent
    under the rules the server and the in-process ``LLM`` apply (``teacher_server.candidates``):
    K must be at least 1, rows must all hold K ids, ids must be integers. Raises ``ValueError``
    (``TypeError`` for non-integer ids)."""
    return candidate_ids(candidates)


def encode_candidates(candidates: Candidates) -> str:
    """Candidates ([K] shared or [rows, K] per row, -1 pads) -> base64 ``.npy`` int32."""
    arr = candidate_ids(candidates)
    check_int32(arr)
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr, dtype="<i4"), allow_pickle=False)
    return b64.encode(buf.getbuffer())


def _whole(value: Any, name: str) -> int:
    """``value`` as an int where it is one (a Python or numpy integer; not a bool): a float or
    a string would be a 400 from the server, so it is a TypeError here, before anything is sent
    (``int(1.5)`` would quietly score other rows)."""
    if not is_whole(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    return int(value)


def build_body(req: TeacherRequest, model: str | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /inference/v1/generate`` for one request."""
    toks = integer_ids(req.token_ids, "token_ids") if isinstance(req.token_ids, list | tuple) \
        else np.asarray(req.token_ids)  # (a list holding True is refused: numpy would send id 1)
    if toks.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ids, got shape {list(toks.shape)}")
    if toks.size and toks.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integer ids, got dtype {toks.dtype}")
    if toks.size and toks.dtype.kind == "u" and toks.max() > np.iinfo(np.int64).max:  # (int64 would wrap it to -1)
        raise ValueError(f"token_ids: id {int(toks.max())} is out of range")
    sp: dict[str, Any] = {"prompt_logprob_start": _whole(req.start, "start"),
                          "max_tokens": _whole(req.max_tokens, "max_tokens")}
    if req.candidates is not None:
        sp["prompt_logprob_token_ids"] = encode_candidates(req.candidates)
    elif req.targets is None or not req.targets.fields():
        raise ValueError("candidates is None and no targets are asked: nothing to score")
    if req.targets is not None:
        sp.update(req.targets.fields())
    if req.prompt_logprobs is not None:
        sp["prompt_logprobs"] = _whole(req.prompt_logprobs, "prompt_logprobs")
    body: dict[str, Any] = {"token_ids": toks.astype(np.int64).tolist(), "sampling_params": sp}
    if req.priority:
        body["priority"] = _whole(req.priority, "priority")
    for key, value in (("request_id", req.request_id), ("cache_salt", req.cache_salt), ("model", model)):
        if value is not None:
            body[key] = value
    return body


def parse_output(data: Mapping[str, Any], expect_scores: bool = True) -> ScoreOutput:
    """A 200 response body -> ``ScoreOutput`` (the matrix decoded without unpickling, and
    without ``np.load``, which fails now and then on worker threads: see ``teacher_server.npy``)."""
    raw = data.get("prompt_token_id_logprobs")
    if raw is None and expect_scores:
        raise TeacherServerError("response has no prompt_token_id_logprobs", status=200)
    scores = None if raw is None else _npy(raw).astype(np.float32, copy=False)
    targets = {name: None if data.get(key) is None else _npy(data[key]) for name, key in _TARGET_FIELDS.items()}
    toks = (data.get("choices") or [{}])[0].get("token_ids") or []
    usage = data.get("usage") or {}
    return ScoreOutput(scores=scores, request_id=data.get("request_id", ""), model=data.get("model", ""),
                       next_token=int(toks[0]) if toks else None,
                       prompt_tokens=int(usage.get("prompt_tokens", 0)),
                       cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                       prompt_logprobs=data.get("prompt_logprobs"), **targets)


_TARGET_FIELDS = {"topk_ids": "prompt_topk_token_ids", "topk_logprobs": "prompt_topk_logprobs",
                  "union_ids": "prompt_union_token_ids", "union_logprobs": "prompt_union_logprobs",
                  "actual_logprobs": "prompt_actual_logprobs", "tail_logprobs": "prompt_tail_logprobs",
                  "logsumexp": "prompt_logsumexp"}


def _npy(raw: str) -> np.ndarray:
    return load_npy(b64.decode(raw, validate=False))
