"""JSON bytes -> validated request, with early checks on the bytes of a large body: the length
of ``token_ids``, and the number of values it holds."""

from __future__ import annotations

import re
import uuid
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from teacher_server.engine.request import ScoreRequest
from teacher_server.server.protocol import GenerateRequest, SamplingParams
from teacher_server.validation import STREAM_MESSAGE, BadRequest, Limits, RowTargets, build_request, check_n

# `"token_ids": [` as a key: inside a JSON string every `"` is escaped, so this only
# matches a key (the top-level one, or a key of some nested object; see below).
_IDS_KEYS = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*\[') for key in ("token_ids", "prompt", "input_ids")}
# each endpoint's key of its prompt's ids
IDS_KEY = {"generate": "token_ids", "completions": "prompt", "sglang-generate": "input_ids"}
M = TypeVar("M", bound=BaseModel)
PRECHECK_BYTES = 64 * 1024  # bodies below this are parsed at once (counting would gain nothing)


def count_token_ids(raw: bytes | bytearray, above: int = -1, key: str = "token_ids") -> int | None:
    """The number of elements of the top-level ``key`` array (``token_ids``), counted on the bytes
    (C-speed ``find``/``count``, no Python objects per id), when it is more than ``above``;
    else, or when it cannot be told that way, None. A body of 20M ids is then refused in
    milliseconds instead of being parsed into 20M Python ints (seconds and gigabytes) first.

    The first ``"token_ids": [`` key is taken; its array runs to the first ``]`` (a valid
    one is flat). That it is the top-level member is verified by parsing the body with
    the array replaced by a marker string: only the top-level member then reads as it.
    That parse is as long as the real one, so it is made only for a count over ``above``:
    a count within it refuses nothing (a request within the limits pays one parse)."""
    m = _IDS_KEYS[key].search(raw)
    if m is None:
        return None
    end = raw.find(b"]", m.end())
    if end < 0 or raw.find(b'"', m.end(), end) >= 0:  # (a quote: strings, such as text prompts, not ids)
        return None
    n = raw.count(b",", m.end(), end) + 1  # elements of a non-empty flat array
    if n <= above:
        return None
    marker = "slot-" + uuid.uuid4().hex
    try:
        rest = orjson.loads(raw[:m.end() - 1] + b'"' + marker.encode() + b'"' + raw[end + 1:])
    except orjson.JSONDecodeError:
        return None
    return n if isinstance(rest, dict) and rest.get(key) == marker else None


def refuse_long_prompt(raw: bytes | bytearray, endpoint: str, max_model_len: int) -> None:
    """BadRequest when a large body's prompt (the top-level flat id array of ``endpoint``'s
    key: ``IDS_KEY``) holds more than ``max_model_len`` ids, told from its bytes before they
    are parsed into Python objects (a 25 MB prompt: milliseconds, not seconds and 12 times the
    body in memory). A batch of prompts is left to the parse, and so is a ``/v1/completions``
    body that names ``truncate_prompt_tokens`` (vLLM then cuts a long prompt)."""
    key = IDS_KEY[endpoint]
    if len(raw) <= PRECHECK_BYTES or (endpoint == "completions" and b'"truncate_prompt_tokens"' in raw):
        return
    n = count_token_ids(raw, above=max_model_len, key=key)
    if n is not None:
        raise BadRequest(f"{key} has {n} tokens, more than max_model_len={max_model_len}", key)


def max_commas(limits: Limits) -> int:
    """The most commas this server parses in one request body: twice what the largest request
    it can score holds (``token_ids`` and per-row JSON candidates: rows x K elements, at most
    ``max_rows_x_k``, a separator per row; base64 candidates hold none), which leaves room for
    the vLLM fields it accepts and ignores (a token mask, offsets, a vocabulary-sized id list),
    plus a vocabulary's worth. A body of many times a request's values is what it refuses."""
    cand = min(limits.max_rows_x_k, limits.max_model_len * limits.max_logprobs)
    return 2 * (2 * limits.max_model_len + cand) + limits.vocab_size + 65536


def row_targets(sp: SamplingParams) -> RowTargets:
    """The row targets a request's sampling parameters ask for."""
    return RowTargets(topk=sp.prompt_logprob_topk, union=bool(sp.prompt_logprob_union),
                      actual=bool(sp.prompt_logprob_actual), tail=bool(sp.prompt_logprob_tail),
                      logsumexp=bool(sp.prompt_logprob_logsumexp), temperature=sp.prompt_logprob_temperature)


def body_request_id(obj: object) -> str | None:
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def json_object(raw: bytes | bytearray) -> dict:
    """A request body's JSON object; BadRequest when it is not valid JSON or not an object."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    return obj


def as_model(obj: dict, model: type[M]) -> M:
    """``obj`` validated as ``model``; BadRequest naming the field otherwise."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise BadRequest(*pydantic_message(e.errors())) from None


def validated(raw: bytes | bytearray, model: type[M], obj: dict | None = None) -> M:
    """JSON bytes -> ``model`` (the endpoints' request bodies); BadRequest naming the field
    otherwise. ``obj``: the bytes' JSON object where it was parsed already (the choice among
    several teachers: ``Teachers.pick``), validated without a second parse."""
    return as_model(json_object(raw) if obj is None else obj, model)


def parse_request(raw: bytes | bytearray, limits: Limits, served_model_name: str,
                  header_request_id: str | None = None, aliases: tuple[str, ...] = (),
                  obj: dict | None = None) -> tuple[GenerateRequest, ScoreRequest]:
    """JSON bytes -> (GenerateRequest, ScoreRequest); BadRequest (400/404) otherwise, with
    ``request_id`` set to the body's id when it could be read (for the log line).
    ``header_request_id`` (X-Request-Id) names the request when the body does not;
    ``aliases``: other names accepted as ``model``; ``obj``: the bytes' JSON object where it
    was parsed already (``validated``). The byte checks of a large body run either way: a
    body refused by them is refused alike, parsed or not."""
    refuse_long_prompt(raw, "generate", limits.max_model_len)
    if len(raw) > PRECHECK_BYTES:
        # Whatever its keys say (an escaped or repeated key, a nested one first, a large ignored
        # field): a body with many more values than a request can use is refused unparsed.
        commas, most = raw.count(b","), max_commas(limits)
        if commas > most:
            raise BadRequest(f"request body holds {commas} comma-separated JSON values, more than this server parses "
                             f"in a request ({most}: twice the largest request at max_model_len="
                             f"{limits.max_model_len}, max_logprobs={limits.max_logprobs})")
    obj = json_object(raw) if obj is None else obj
    try:
        body = as_model(obj, GenerateRequest)
        if body.model is not None and body.model != served_model_name and body.model not in aliases:
            raise BadRequest(f"model {body.model[:200]!r} does not exist; this server serves {served_model_name!r}",
                             "model", status=404)
        if body.stream:
            raise BadRequest(STREAM_MESSAGE, "stream")
        sp = body.sampling_params
        check_n(sp.n, "sampling_params.n")  # (vLLM would answer n sampled choices)
        rid = body.request_id if body.request_id is not None else header_request_id  # "" is an id
        req = build_request(
            token_ids=body.token_ids, limits=limits, candidates=sp.prompt_logprob_token_ids,
            start=sp.prompt_logprob_start, prompt_logprobs=sp.prompt_logprobs, max_tokens=sp.max_tokens,
            request_id=rid, cache_salt=body.cache_salt, priority=body.priority,
            truncate_prompt_tokens=sp.truncate_prompt_tokens, targets=row_targets(sp),
            sampling_temperature=sp.temperature)
    except BadRequest as e:
        rid = body_request_id(obj)
        e.request_id = rid if rid is not None else header_request_id
        raise
    return body, req


def _is_branch(p: object) -> bool:
    """A union-branch marker pydantic puts in an error's location (e.g. 'list[int]', 'str')."""
    return isinstance(p, str) and ("[" in p or p in ("str", "int", "bool", "float"))


def _union_choice(errors: list, e: dict) -> dict:
    """Of the union's branches at ``e``'s first marker, the error of the branch that got
    furthest into the value: the latest first bad element (a per-row list whose row 1 is not a
    list names row 1, not the flat branch's complaint about row 0), then the deepest error."""
    loc = tuple(e.get("loc", ()))
    at = next((i for i, p in enumerate(loc) if _is_branch(p)), None)
    if at is None:
        return e
    branches: dict[object, list] = {}
    for x in errors:
        xl = tuple(x.get("loc", ()))
        if len(xl) > at and xl[:at] == loc[:at] and _is_branch(xl[at]):
            branches.setdefault(xl[at], []).append(x)

    def first_bad(errs: list) -> int:  # -1: the value itself is not of the branch's kind
        return min((x["loc"][at + 1] if len(x["loc"]) > at + 1 and isinstance(x["loc"][at + 1], int) else -1)
                   for x in errs)

    best = max(branches.values(), key=lambda errs: (first_bad(errs), max(len(x["loc"]) for x in errs)))
    return max(best, key=lambda x: len(x["loc"]))


def pydantic_message(errors: list) -> tuple[str, str | None]:
    """(message, param) of the deepest pydantic error (the first of those), naming the field:
    of a union's branches, the one that got furthest into the value (``_union_choice``)."""
    e = max(errors, key=lambda x: len(x.get("loc", ()))) if errors else {"loc": (), "msg": "invalid request"}
    e = _union_choice(errors, e) if errors else e
    loc = [str(p) for p in e.get("loc", ()) if p not in ("body",)]
    # Drop union-branch markers pydantic adds (e.g. 'list[int]'), keep field names and indices.
    loc = [p for p in loc if not _is_branch(p)]
    param = ".".join(p for p in loc if not p.isdigit()) or None
    where = ".".join(loc) or "body"
    msg = str(e.get("msg", "invalid value"))
    if e.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif e.get("type") == "missing":
        msg = "field required"
    # (a field's name comes from the body: capped, so the error never echoes a long key whole)
    where = where if len(where) <= 200 else where[:200] + "..."
    return f"{where}: {msg}"[:500], None if param is None else param[:200]
