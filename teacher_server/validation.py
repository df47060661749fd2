"""Turn client input into a validated ScoreRequest, or raise BadRequest naming the field.

Shared by the HTTP server and the in-process Python API, so both enforce one contract.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from teacher_server import b64
from teacher_server.engine.request import ScoreRequest
from teacher_server.npy import load_npy

STREAM_MESSAGE = "prompt_logprob_token_ids are not available when stream=true."


class BadRequest(ValueError):
    """A client error: HTTP 400 (or ``status``) with vLLM's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.request_id: str | None = None  # the request's id when known (logged with the error)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_rows_x_k: int
    # Cap on (len(token_ids) - 1) * (prompt_logprobs + 1), the entries of the classic JSON
    # prompt_logprobs (the HTTP response's largest part); None: no cap (in-process API).
    max_prompt_logprobs_entries: int | None = None


def decode_npy(data: str, param: str) -> np.ndarray:
    """base64 `.npy` -> int64 integer array. Never unpickles; read without `np.load` (see
    `teacher_server.npy`: on the CPythons this supports, `np.load` fails now and then while
    another thread parses Python source)."""
    return _to_int64(_decode_npy_as_sent(data, param), param)


def _decode_npy_as_sent(data: str, param: str) -> np.ndarray:
    """``decode_npy`` without the int64 conversion: the integer array in the dtype it was sent in."""
    try:
        raw = b64.decode(data)
    except ValueError:  # (binascii.Error too)
        raise BadRequest(f"{param} is not valid base64", param) from None
    try:
        arr = load_npy(raw)
    except ValueError as e:  # the reader says what is wrong (no magic, truncated, object arrays, ...)
        raise BadRequest(f"{param} is not a valid .npy array: {str(e)[:200]}", param) from None
    except Exception:
        raise BadRequest(f"{param} is not a valid .npy array", param) from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise BadRequest(f"{param} must be an integer array (int32 or int64), got {getattr(arr, 'dtype', type(arr))}",
                         param)
    if arr.ndim not in (1, 2):
        raise BadRequest(f"{param} must have shape [K] or [rows, K], got {list(arr.shape)}", param)
    return arr


def _to_int64(arr: np.ndarray, param: str) -> np.ndarray:
    """int64 copy; unsigned values beyond int64 are refused (they would wrap to negatives)."""
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise BadRequest(f"{param}: id {int(arr.max())} is out of range", param)
    return arr.astype(np.int64, copy=False)


def _as_int_array(x: Any, param: str) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (OverflowError, ValueError, TypeError):
        raise BadRequest(f"{param} must be a list of integer ids (or a list of equal-length rows)", param) from None
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":  # floats, bools, strings, ragged or huge (object) values
        raise BadRequest(f"{param} must hold integer ids within int64", param)
    return _to_int64(arr, param)


def parse_candidates(value: Any, rows: int, limits: Limits, param: str) -> np.ndarray:
    """Candidates in any accepted form -> [K] (shared) or [rows, K] (per row) int32, checked
    in int64 first, or in the signed dtype a binary array was sent in (every id is in
    [-1, vocab), so int32 holds it: half the bytes a request carries to the engine's process)."""
    if isinstance(value, str):
        arr = _decode_npy_as_sent(value, param)
        if arr.dtype.kind == "u":  # (signed ids compare as sent: no widened copy of int32 ones)
            arr = _to_int64(arr, param)
        per_row = arr.ndim == 2
    elif isinstance(value, np.ndarray):  # the in-process API's arrays: checked as the binary form is
        arr = _as_int_array(value, param)
        if arr.ndim not in (1, 2):
            raise BadRequest(f"{param} must have shape [K] or [rows, K], got {list(arr.shape)}", param)
        per_row = arr.ndim == 2
    elif isinstance(value, (list, tuple)):
        per_row = len(value) > 0 and isinstance(value[0], (list, tuple))
        if per_row:
            if any(not isinstance(r, (list, tuple)) for r in value):
                raise BadRequest(f"{param}: mix of ids and lists; use a flat list or a list of rows", param)
            lens = {len(r) for r in value}
            if len(lens) != 1:
                raise BadRequest(f"{param}: every row must have the same number of candidates "
                                 f"(pad with -1); got lengths {sorted(lens)[:4]}", param)
        elif any(isinstance(r, (list, tuple)) for r in value):
            raise BadRequest(f"{param}: mix of ids and lists; use a flat list or a list of rows", param)
        arr = _as_int_array(value, param)
    else:
        raise BadRequest(f"{param} must be a list of ids, a list of rows, or a base64 .npy string", param)
    k = arr.shape[-1]
    if k == 0:
        raise BadRequest(f"{param}: K must be at least 1 in every form (a flat list, rows of ids, or a .npy array); "
                         "zero rows with K candidates are a flat list of K ids or a [0, K] array", param)
    if k > limits.max_logprobs:
        raise BadRequest(f"{param}: K={k} exceeds max_logprobs={limits.max_logprobs}", param)
    if per_row:
        if arr.shape[0] != rows:
            raise BadRequest(f"{param}: got {arr.shape[0]} candidate rows, expected rows={rows} "
                             f"(len(token_ids) - 1 - prompt_logprob_start)", param)
        bad = (arr < -1) | (arr >= limits.vocab_size)
        if bad.any():
            v = int(arr[bad][0])
            raise BadRequest(f"{param}: id {v} is outside [0, {limits.vocab_size}) (-1 pads)", param)
    else:
        bad = (arr < 0) | (arr >= limits.vocab_size)
        if bad.any():
            v = int(arr[bad][0])
            raise BadRequest(f"{param}: id {v} is outside [0, {limits.vocab_size})", param)
    if rows * k > limits.max_rows_x_k:
        raise BadRequest(f"{param}: rows*K={rows * k} exceeds the limit {limits.max_rows_x_k}", param)
    return np.ascontiguousarray(arr, dtype=np.int32)


def build_request(*, token_ids: Any, limits: Limits, candidates: Any = None, start: int | None = None,
                  prompt_logprobs: int | None = None, max_tokens: int | None = 1, request_id: str | None = None,
                  cache_salt: str | None = None, priority: int = 0,
                  truncate_prompt_tokens: int | None = None) -> ScoreRequest:
    sp = "sampling_params."
    toks = _as_int_array(token_ids, "token_ids")  # an array of the in-process API too: floats and bools refused
    if toks.ndim != 1 or toks.size == 0:
        raise BadRequest("token_ids must be a non-empty list of ids", "token_ids")
    if toks.size > limits.max_model_len:
        raise BadRequest(f"token_ids has {toks.size} tokens, more than max_model_len={limits.max_model_len}",
                         "token_ids")
    bad = (toks < 0) | (toks >= limits.vocab_size)
    if bad.any():
        raise BadRequest(f"token_ids: id {int(toks[bad][0])} is outside [0, {limits.vocab_size})", "token_ids")
    if cache_salt is not None and cache_salt == "":
        raise BadRequest("cache_salt must be a non-empty string", "cache_salt")
    if truncate_prompt_tokens is not None:
        raise BadRequest("truncate_prompt_tokens is not supported: inputs are never truncated",
                         sp + "truncate_prompt_tokens")
    mt = 1 if max_tokens is None else max_tokens
    if mt not in (0, 1):
        raise BadRequest(f"max_tokens must be 0 or 1 (this server scores, it does not generate); got {mt}",
                         sp + "max_tokens")
    if start is not None and candidates is None:
        raise BadRequest("prompt_logprob_start needs prompt_logprob_token_ids", sp + "prompt_logprob_start")
    s = 0 if start is None else start
    if s < 0:
        raise BadRequest(f"prompt_logprob_start must be >= 0, got {s}", sp + "prompt_logprob_start")
    rows = max(int(toks.size) - 1 - s, 0)
    cand = None
    if candidates is not None:
        cand = parse_candidates(candidates, rows, limits, sp + "prompt_logprob_token_ids")
    if prompt_logprobs is not None:
        cap = min(limits.max_logprobs, limits.vocab_size)
        if prompt_logprobs < 0 or prompt_logprobs > cap:
            raise BadRequest(f"prompt_logprobs must be in [0, {cap}], got {prompt_logprobs}", sp + "prompt_logprobs")
        entries = (int(toks.size) - 1) * (prompt_logprobs + 1)
        if limits.max_prompt_logprobs_entries is not None and entries > limits.max_prompt_logprobs_entries:
            raise BadRequest(f"prompt_logprobs={prompt_logprobs} on {toks.size} tokens makes {entries} entries, more "
                             f"than max_prompt_logprobs_entries={limits.max_prompt_logprobs_entries}; ask for fewer, "
                             "or score candidates with prompt_logprob_token_ids", sp + "prompt_logprobs")
    return ScoreRequest(
        request_id=request_id if request_id is not None else f"score-{uuid.uuid4().hex}",
        token_ids=toks, start=s, candidates=cand, prompt_logprobs=prompt_logprobs, max_tokens=mt,
        cache_salt=cache_salt, priority=priority)
