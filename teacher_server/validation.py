"""Turn client input into a validated ScoreRequest, or raise BadRequest naming the field.

Shared by the HTTP server and the in-process Python API, so both enforce one contract.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from teacher_server import b64
from teacher_server.candidates import (
    InvalidIds,
    candidate_ids,
    check_candidate_bounds,
    integer_ids,
    is_whole,
    signed_ids,
)
from teacher_server.engine.request import ScoreRequest
from teacher_server.npy import load_npy

STREAM_MESSAGE = "prompt_logprob_token_ids are not available when stream=true."
FLOAT32_MAX = 3.4028234663852886e38  # a temperature divides float32 logits: above this it is infinite


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
    # logprobs_mode processed_logprobs: a request's sampling temperature scales its scores
    processed: bool = False
    # Accepted priorities are -priority_limit..priority_limit; None: any (in-process API).
    priority_limit: int | None = None
    # The most prompts one call of a batch endpoint holds: what the queue holds at once (a batch
    # is admitted whole, so a larger one never could be); None: no cap (in-process API).
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.max_logprobs == -1:  # (vLLM's -1: no cap but the vocabulary)
            object.__setattr__(self, "max_logprobs", self.vocab_size)


@dataclass(frozen=True)
class RowTargets:
    """What a request asks of its scored rows besides the candidates (the native endpoint's
    ``prompt_logprob_topk`` ... ``prompt_logprob_temperature``; the in-process API's fields)."""

    topk: int | None = None
    union: bool = False
    actual: bool = False
    tail: bool = False
    logsumexp: bool = False
    temperature: float | None = None

    @property
    def any_rows(self) -> bool:
        return bool(self.topk or self.actual or self.tail or self.logsumexp)

    def check(self, rows: int, cand_k: int, limits: Limits) -> None:
        """Raise BadRequest naming the field for values the engine cannot honour; ``cand_k``:
        the candidates' K (0: no candidates)."""
        sp = "sampling_params."
        if self.topk is not None:
            integer(self.topk, sp + "prompt_logprob_topk")
            cap = min(limits.max_logprobs, limits.vocab_size)
            if not 1 <= self.topk <= cap:
                raise BadRequest(f"prompt_logprob_topk must be in [1, {cap}], got {self.topk}",
                                 sp + "prompt_logprob_topk")
            if rows * self.topk > limits.max_rows_x_k:
                raise BadRequest(f"prompt_logprob_topk={self.topk} on {rows} rows is {rows * self.topk} values, more "
                                 f"than max_rows_x_k={limits.max_rows_x_k}", sp + "prompt_logprob_topk")
        if self.union and not (cand_k and self.topk):
            raise BadRequest("prompt_logprob_union needs prompt_logprob_token_ids and prompt_logprob_topk",
                             sp + "prompt_logprob_union")
        if self.union and rows * (cand_k + self.topk) > limits.max_rows_x_k:  # ([rows, Kc + K], one result too)
            raise BadRequest(f"prompt_logprob_union of {cand_k} candidates and top-{self.topk} on {rows} rows is "
                             f"{rows * (cand_k + self.topk)} values, more than max_rows_x_k={limits.max_rows_x_k}",
                             sp + "prompt_logprob_union")
        if self.tail and not (cand_k or self.topk):
            raise BadRequest("prompt_logprob_tail needs columns to be outside of: prompt_logprob_token_ids and/or "
                             "prompt_logprob_topk", sp + "prompt_logprob_tail")
        t = self.temperature
        # below 1e-5 (vLLM's greedy threshold) logits / t overflow float32 and the softmax is NaN; above
        # float32's largest number t itself is infinite there (an int past a float's range: compared exactly)
        if t is not None and not (isinstance(t, int | float) and not isinstance(t, bool)
                                  and 1e-5 <= t <= FLOAT32_MAX and math.isfinite(t)):
            raise BadRequest(f"prompt_logprob_temperature must be a number from 1e-5 to {FLOAT32_MAX:.7g}, "
                             f"got {t!r:.60}", sp + "prompt_logprob_temperature")


def decode_npy(data: str, param: str) -> np.ndarray:
    """base64 `.npy` candidates -> int64 array of shape [K] or [rows, K] (the rules of
    ``teacher_server.candidates``). Never unpickles; read without `np.load` (see
    `teacher_server.npy`: on the CPythons this supports, `np.load` fails now and then while
    another thread parses Python source)."""
    try:
        return signed_ids(candidate_ids(_load_npy(data, param), param), param).astype(np.int64, copy=False)
    except InvalidIds as e:
        raise BadRequest(str(e), param) from None


def _load_npy(data: str, param: str) -> np.ndarray:
    """base64 `.npy` -> the array as sent (its dtype and shape are the caller's to check); bytes
    after its data are refused (``exact``), never cut off."""
    try:
        raw = b64.decode(data)
    except ValueError:  # (binascii.Error too)
        raise BadRequest(f"{param} is not valid base64", param) from None
    try:
        return load_npy(raw, exact=True)
    except ValueError as e:  # the reader says what is wrong (no magic, truncated, object arrays, ...)
        raise BadRequest(f"{param} is not a valid .npy array: {str(e)[:200]}", param) from None
    except Exception:
        raise BadRequest(f"{param} is not a valid .npy array", param) from None


def parse_candidates(value: Any, rows: int, limits: Limits, param: str) -> np.ndarray:
    """Candidates in any accepted form (a list, rows of ids, an integer array, or a base64 .npy
    string of one) -> [K] (shared) or [rows, K] (per row) int32, under the rules of
    ``teacher_server.candidates``. Signed ids are range-checked in the dtype they came in,
    unsigned ones in int64 (every id is in [-1, vocab), so int32 holds it: half the bytes a
    request carries to the engine's process)."""
    try:
        arr = signed_ids(candidate_ids(_load_npy(value, param) if isinstance(value, str) else value, param), param)
        check_candidate_bounds(arr, rows=rows, vocab_size=limits.vocab_size, max_logprobs=limits.max_logprobs,
                               max_rows_x_k=limits.max_rows_x_k, name=param)
    except InvalidIds as e:
        raise BadRequest(str(e), param) from None
    return _own(np.ascontiguousarray(arr, dtype=np.int32), value)


def _own(arr: np.ndarray, value: Any) -> np.ndarray:
    """``arr``, made from the caller's ``value``, as memory of the request's own: the in-process
    API's arrays (numpy, torch, a memoryview) are read as views, and a caller changing one after
    submitting would change what the engine scores, and what the prefix cache keeps under the
    hash of what was validated."""
    return arr if isinstance(value, str | list | tuple) or (arr.base is None and arr is not value) else arr.copy()


def _token_ids(value: Any) -> np.ndarray:
    """Token ids as int64 under the candidates' integer rule (an array of the in-process API
    too: floats and bools refused)."""
    try:
        return _own(signed_ids(integer_ids(value, "token_ids"), "token_ids").astype(np.int64, copy=False), value)
    except InvalidIds as e:
        raise BadRequest(str(e), "token_ids") from None


def _sampling_temperature(value: Any, param: str) -> float | None:
    """The request's sampling ``temperature`` as vLLM's request models read it: a number, or a
    string of one ("0.7"), not negative. Anything else is a 400: ignored, it would leave a server
    in ``processed_logprobs`` mode returning unscaled scores without a word."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    try:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # (an integer beyond float's range)
        ok = False
    if not ok:
        raise BadRequest(f"temperature must be a finite number, got {value!r:.40}", param)
    if value < 0:  # (vLLM's and SGLang's sampling parameters refuse it too)
        raise BadRequest(f"temperature must be non-negative, got {float(value)}", param)
    if value > FLOAT32_MAX:  # (infinite in the float32 it divides the logits in)
        raise BadRequest(f"temperature must be at most {FLOAT32_MAX:.7g} (float32's largest), got {float(value)}",
                         param)
    return float(value)


def check_in_vocab(ids: Any, limits: Limits, param: str) -> None:
    """BadRequest naming ``param`` and its first id outside ``[0, vocab_size)`` (a list or an
    integer array; ids beyond int64 compare as Python ints)."""
    arr = np.asarray(ids)
    bad = (arr < 0) | (arr >= limits.vocab_size)
    if bad.any():
        raise BadRequest(f"{param}: id {int(arr[bad][0])} is outside [0, {limits.vocab_size})", param)


def check_n(value: Any, param: str) -> None:
    """A request's ``n``, which only 1 may be (nothing is sampled here): absent, 1 or 1.0, as
    vLLM's and SGLang's request checks read it; a bool or a string is a client's slip."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float | np.integer)
                              or value != 1):
        raise BadRequest(f"{param} must be 1 (this server does not sample), got {value!r:.40}", param)


def renamed(e: BadRequest, names: dict[str, str], prefix: str = "") -> BadRequest:
    """``e`` (from ``build_request``, which names the native request's fields) in another
    endpoint's words: each field in ``names`` becomes its value, in ``param`` and in the message
    alike; any other ``sampling_params.`` field becomes ``prefix`` + its name (a trainers'
    endpoint whose sampling fields sit at the top level passes ""). Longer names are replaced
    first, and only where a whole name stands ("token_ids" inside "prompt_logprob_token_ids" is
    not one)."""
    def one(text: str) -> str:
        for ours in sorted(names, key=len, reverse=True):
            text = re.sub(rf"(?<![\w.]){re.escape(ours)}(?!\w)", names[ours], text)
        return re.sub(r"(?<![\w.])sampling_params\.(?=\w)", prefix, text)

    def outside_quotes(text: str) -> str:  # (a quoted value the client sent is theirs: left as it was)
        parts = re.split(r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")", text)
        return "".join(p if i % 2 else one(p) for i, p in enumerate(parts))

    out = BadRequest(outside_quotes(e.message), None if e.param is None else one(e.param), e.status)
    out.request_id = e.request_id
    return out


def check_batch(n: int, limits: Limits, param: str) -> None:
    """BadRequest naming ``param`` for a batch of ``n`` prompts the queue can never hold at once
    (refused before its prompts are read: not a 429 that no wait would cure)."""
    if limits.max_prompts is not None and n > limits.max_prompts:
        raise BadRequest(f"a batch of {n} prompts is more than the queue holds at once ({limits.max_prompts}, "
                         "max_queue_requests): send it in parts", param)


def integer(value: Any, param: str) -> int:
    """``value`` as an int: a Python or numpy integer (not a bool, not a float); else BadRequest
    naming ``param``. (The in-process API's values meet the engine's arithmetic as they come: a
    numpy unsigned start wrapped its block count round, a float one failed inside the step.)"""
    if not is_whole(value):
        raise BadRequest(f"{param.rsplit('.', 1)[-1]} must be an integer, got {type(value).__name__} {value!r:.40}",
                         param)
    return int(value)


def check_priority(priority: int, limits: Limits) -> None:
    """BadRequest naming ``priority`` outside -priority_limit..priority_limit."""
    if limits.priority_limit is not None and abs(priority) > limits.priority_limit:
        raise BadRequest(f"priority must be in [-{limits.priority_limit}, {limits.priority_limit}] "
                         f"(priority_limit), got {priority}", "priority")


def build_request(*, token_ids: Any, limits: Limits, candidates: Any = None, start: int | None = None,
                  prompt_logprobs: int | None = None, max_tokens: int | None = 1, request_id: str | None = None,
                  cache_salt: str | None = None, priority: int = 0,
                  truncate_prompt_tokens: int | None = None, targets: RowTargets | None = None,
                  sampling_temperature: Any = None) -> ScoreRequest:
    """``targets``: what else to return for the scored rows (``RowTargets``; None: nothing);
    ``sampling_temperature``: the request's sampling temperature, which divides its logits in
    ``processed_logprobs`` mode (unless ``targets`` names a temperature; 0 and None: 1)."""
    tg = targets if targets is not None else RowTargets()
    sp = "sampling_params."
    toks = _token_ids(token_ids)
    if toks.ndim != 1 or toks.size == 0:
        raise BadRequest("token_ids must be a non-empty list of ids", "token_ids")
    if toks.size > limits.max_model_len:
        raise BadRequest(f"token_ids has {toks.size} tokens, more than max_model_len={limits.max_model_len}",
                         "token_ids")
    check_in_vocab(toks, limits, "token_ids")
    priority = integer(priority, "priority")
    check_priority(priority, limits)
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise BadRequest("cache_salt must be a non-empty string", "cache_salt")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"request_id must be a string, got {type(request_id).__name__}", "request_id")
    start = None if start is None else integer(start, sp + "prompt_logprob_start")
    prompt_logprobs = None if prompt_logprobs is None else integer(prompt_logprobs, sp + "prompt_logprobs")
    max_tokens = None if max_tokens is None else integer(max_tokens, sp + "max_tokens")
    if truncate_prompt_tokens is not None:
        raise BadRequest("truncate_prompt_tokens is not supported: inputs are never truncated",
                         sp + "truncate_prompt_tokens")
    mt = 1 if max_tokens is None else max_tokens
    if mt not in (0, 1):
        raise BadRequest(f"max_tokens must be 0 or 1 (this server scores, it does not generate); got {mt}",
                         sp + "max_tokens")
    if start is not None and candidates is None and not tg.any_rows:
        raise BadRequest("prompt_logprob_start needs prompt_logprob_token_ids (or a row target such as "
                         "prompt_logprob_topk)", sp + "prompt_logprob_start")
    s = 0 if start is None else start
    if s < 0:
        raise BadRequest(f"prompt_logprob_start must be >= 0, got {s}", sp + "prompt_logprob_start")
    rows = max(int(toks.size) - 1 - s, 0)
    cand = None
    if candidates is not None:
        cand = parse_candidates(candidates, rows, limits, sp + "prompt_logprob_token_ids")
    if prompt_logprobs is not None:
        cap = min(limits.max_logprobs, limits.vocab_size)
        k = limits.vocab_size if prompt_logprobs == -1 else prompt_logprobs  # (vLLM's -1: every id)
        if prompt_logprobs == -1 and k > cap:  # allowed, but not on this server's settings
            raise BadRequest(f"prompt_logprobs=-1 asks for every id ({k}), more than "
                             f"max_logprobs={limits.max_logprobs} allows: ask for at most {cap}, or start the "
                             f"server with --max-logprobs -1",
                             sp + "prompt_logprobs")
        if k < 0 or k > cap:
            raise BadRequest(f"prompt_logprobs must be -1 or in [0, {cap}] (max_logprobs), got {prompt_logprobs}",
                             sp + "prompt_logprobs")
        prompt_logprobs = k
        entries = (int(toks.size) - 1) * (prompt_logprobs + 1)
        if limits.max_prompt_logprobs_entries is not None and entries > limits.max_prompt_logprobs_entries:
            raise BadRequest(f"prompt_logprobs={prompt_logprobs} on {toks.size} tokens makes {entries} entries, more "
                             f"than max_prompt_logprobs_entries={limits.max_prompt_logprobs_entries}; ask for fewer, "
                             "or use POST /inference/v1/generate with prompt_logprob_token_ids (candidates) or "
                             "prompt_logprob_topk (binary arrays)", sp + "prompt_logprobs")
    tg.check(rows, 0 if cand is None else int(cand.shape[-1]), limits)
    temp = tg.temperature
    st = _sampling_temperature(sampling_temperature, sp + "temperature")
    if temp is None and limits.processed and st is not None and st >= 1e-5:  # (vLLM: greedy below 1e-5)
        temp = st
    return ScoreRequest(
        request_id=request_id if request_id is not None else f"score-{uuid.uuid4().hex}",
        token_ids=toks, start=s, candidates=cand, prompt_logprobs=prompt_logprobs, max_tokens=mt,
        cache_salt=cache_salt, priority=priority, top_k=tg.topk or 0, union=tg.union, actual=tg.actual,
        tail=tg.tail, logsumexp=tg.logsumexp, temperature=1.0 if temp is None else float(temp))
