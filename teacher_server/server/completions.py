"""``POST /v1/completions`` as vLLM's OpenAI server answers it, for what teacher scoring uses:
token-id prompts (one list, or a list of lists for a batch; text where the checkpoint has a
tokenizer), ``max_tokens`` 0 or 1 (the greedy token), ``echo``, ``prompt_logprobs: k``
(``choices[i].prompt_logprobs``: ``None`` at position 0, then ``{"<id>": {logprob, rank,
decoded_token}}`` with the actual token first, then the top-k by rank; ``-1``: the whole
vocabulary), ``logprobs: k`` (OpenAI's ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``, over the echoed prompt and the generated token), ``return_tokens_as_token_ids``
(``"token_id:<id>"`` strings in ``logprobs``), ``return_token_ids``. Fields of vLLM's request that
do not change scores are accepted and ignored, as vLLM does with fields it does not know; the
error shape is vLLM's.

vLLM's rules kept here (vllm/entrypoints/openai/completion/protocol.py and serving.py): with
``echo`` and ``logprobs`` but no ``prompt_logprobs``, the prompt's logprobs are asked with
``logprobs`` as k and come back in ``prompt_logprobs`` too; an echoed position's
``top_logprobs`` is the first ``logprobs + 1`` entries of its ``prompt_logprobs`` entry; with
``echo`` and ``return_token_ids`` the prompt is left out of ``text``; ``decoded_token`` is the
tokenizer's text of the id (None without one), whatever ``return_tokens_as_token_ids`` says;
an actual token among the top-k has its top-k rank (vLLM's entry dict keeps the top-k's);
``logprob_token_ids`` puts the given ids in the generated token's ``top_logprobs`` in place of
its top ``logprobs`` (scored at the last position: the engine's ``next_candidates``) and lifts
the ``logprobs + 1`` cut of every position, with vLLM's refusals.

The JSON of large ``prompt_logprobs`` is the cost of this endpoint: it is built with orjson a
slice of positions at a time, and bounded by ``max_prompt_logprobs_entries`` over the whole
batch (a 400 beyond: the native endpoint returns the same numbers as binary arrays)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.server.parsing import as_model, json_object
from teacher_server.server.protocol import _FF, IntList
from teacher_server.server.responses import NEG_INF_JSON
from teacher_server.server.tokenizer import Tokenizer, require
from teacher_server.validation import BadRequest, Limits, build_request, check_batch, renamed

PLP_SLICE = 512  # positions of prompt_logprobs serialised at a time


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (vLLM's OpenAI-compatible request). Scores the prompt;
    ``max_tokens`` 1 also returns the greedy next token. Other fields of vLLM's request
    (``temperature``, ``top_p``, ``seed``, ``stop``, ...) are accepted and do not change the
    scores."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = Field(None, description="Must name the served model (404 otherwise).")
    prompt: IntList | Annotated[list[IntList], _FF] | StrictStr | Annotated[list[StrictStr], _FF] = Field(
        ..., description="Token ids (a list of ints), a batch of them (a list of lists), or text / a list of texts "
                         "where the checkpoint has a tokenizer.json.")
    max_tokens: StrictInt | None = Field(
        1, description="0 (score the prompt only) or 1 (also the greedy next token; absent = 1). This server does "
                       "not generate: larger values are 400.")
    echo: StrictBool | None = Field(
        False, description="Return the prompt in `text` and (with `logprobs`) its logprobs; with `logprobs` and no "
                           "`prompt_logprobs`, also the prompt's `prompt_logprobs` (k = `logprobs`).")
    logprobs: StrictInt | None = Field(
        None, description="OpenAI logprobs of the returned tokens (the echoed prompt with `echo`, and the generated "
                          "token), with the top `logprobs` alternatives per position (-1: the whole vocabulary).")
    prompt_logprobs: StrictInt | None = Field(
        None, description="vLLM's per-position prompt logprobs: the actual token and the teacher's top-k "
                          "(`choices[i].prompt_logprobs`, None at position 0; -inf written as -9999.0; -1: the "
                          "whole vocabulary).")
    logprob_token_ids: IntList | None = Field(
        None, description="Ids whose logprobs the generated token's `top_logprobs` holds (after the token itself) "
                          "in place of the top `logprobs` (vLLM's; needs `logprobs`).")
    return_tokens_as_token_ids: StrictBool | None = Field(
        None, description="Tokens as `token_id:<id>` strings (in `logprobs.tokens`, `top_logprobs` keys and "
                          "`decoded_token`): no tokenizer needed.")
    return_token_ids: StrictBool | None = Field(None, description="Also `prompt_token_ids` and `token_ids`.")
    add_special_tokens: StrictBool = Field(True, description="For text prompts: add the tokenizer's special tokens.")
    n: StrictInt | None = Field(1, description="1 only.")
    stream: StrictBool | None = Field(False, description="false only.")
    truncate_prompt_tokens: StrictInt | None = Field(
        None, description="vLLM's: score only the last k tokens of each prompt (-1: the last max_model_len); at "
                          "most max_model_len.")
    suffix: StrictStr | None = Field(None, description="Not supported (vLLM's answer too): 400.")
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = Field(None, description="Isolates prefix-cache entries between tenants.")
    priority: StrictInt = 0


@dataclass
class ParsedCompletion:
    body: CompletionRequest
    reqs: list[ScoreRequest]
    request_id: str
    prompt_k: int | None  # the k of the prompt's logprobs (``prompt_logprobs``, or ``logprobs`` with echo)
    logprobs_k: int | None  # ``logprobs`` (-1 resolved to the vocabulary)


def _token_prompts(body: CompletionRequest, tok: Tokenizer | None) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        t = require(tok, "a text prompt")
        texts = [p] if isinstance(p, str) else p
        return [t.encode(x, body.add_special_tokens) for x in texts]
    if isinstance(p, list) and p and isinstance(p[0], list):
        return p
    return [p]


def _truncation(body: CompletionRequest, limits: Limits) -> int | None:
    """``truncate_prompt_tokens`` as the number of last tokens kept (vLLM's rule: -1 is
    max_model_len; larger than max_model_len is refused); None: the prompts as sent."""
    k = body.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return limits.max_model_len
    if k < 1:
        raise BadRequest(f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens")
    if k > limits.max_model_len:
        raise BadRequest(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                         f"({limits.max_model_len}). Please, select a smaller truncation size.",
                         "truncate_prompt_tokens")
    return k


def parse_completion(raw: bytes, limits: Limits, served: str, tok: Tokenizer | None,
                     aliases: tuple[str, ...] = (), header_request_id: str | None = None,
                     obj: dict | None = None) -> ParsedCompletion:
    """JSON bytes -> the engine requests of each prompt; BadRequest (vLLM's 400/404) otherwise.
    ``aliases``: the other served names (``--served-model-name a b``), accepted as ``model``;
    ``header_request_id``: X-Request-Id, which names the completion before the body's
    ``request_id`` does (vLLM's ``_base_request_id``); ``obj``: the body's JSON object where it
    was parsed already (``Teachers.pick``)."""
    obj = json_object(raw) if obj is None else obj
    try:
        return _parse_completion(as_model(obj, CompletionRequest), limits, served, tok, aliases, header_request_id)
    except BadRequest as e:  # (the id the access line names a refusal by: the body's, else the header's)
        rid = header_request_id if header_request_id is not None else obj.get("request_id")
        e.request_id = f"cmpl-{rid}" if isinstance(rid, str) else None  # (as the completion's id would be)
        raise


_NAMES = {"token_ids": "prompt", "sampling_params.prompt_logprob_token_ids": "logprob_token_ids"}


def _parse_completion(body: CompletionRequest, limits: Limits, served: str, tok: Tokenizer | None,
                      aliases: tuple[str, ...], header_request_id: str | None) -> ParsedCompletion:
    if body.model is not None and body.model != served and body.model not in aliases:
        raise BadRequest(f"The model `{body.model[:200]}` does not exist.", "model", status=404)
    if body.stream:
        raise BadRequest("stream=true is not supported: this server scores, it does not stream", "stream")
    if body.n not in (None, 1):
        raise BadRequest(f"n must be 1, got {body.n}", "n")
    if body.suffix is not None:
        raise BadRequest("suffix is not currently supported", "suffix")
    keep = _truncation(body, limits)
    given = body.logprob_token_ids
    if given:  # range-checked whether or not this request scores them
        bad = next((i for i in given if not 0 <= i < limits.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"logprob_token_ids: id {bad} is outside [0, {limits.vocab_size})", "logprob_token_ids")
    if given is not None:  # (vLLM's checks of it, in its words)
        if not given:
            raise BadRequest("`logprob_token_ids` must not be an empty list.", "logprob_token_ids")
        if body.echo and body.max_tokens == 0:
            raise BadRequest("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                             "output tokens are generated.", "logprob_token_ids")
        if body.logprobs is None:
            raise BadRequest("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    kl, kp = (_logprobs_k(body, name, limits) for name in ("logprobs", "prompt_logprobs"))
    if body.logprobs is not None and not body.return_tokens_as_token_ids:
        require(tok, "logprobs with token strings", " and set return_tokens_as_token_ids=true")
    p = body.prompt
    check_batch(len(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else 1, limits, "prompt")
    prompts = _token_prompts(body, tok)
    if not prompts:
        raise BadRequest("prompt must not be empty", "prompt")
    if keep is not None:  # (vLLM keeps a prompt's last tokens)
        prompts = [ids[-keep:] if len(ids) > keep else ids for ids in prompts]
    rid = header_request_id if header_request_id is not None else body.request_id
    rid = f"cmpl-{rid if rid is not None else uuid.uuid4().hex}"
    mt = 1 if body.max_tokens is None else body.max_tokens
    plp = kl if kp is None and body.echo else kp  # (vLLM asks the prompt's logprobs with echo's k)
    entries = 0
    reqs = []
    at_next = given is not None and mt == 1  # the given ids scored at the generated token's position
    for i, ids in enumerate(prompts):
        try:
            req = build_request(token_ids=ids, limits=limits, prompt_logprobs=plp, max_tokens=mt,
                                request_id=f"{rid}-{i}", cache_salt=body.cache_salt, priority=body.priority,
                                candidates=given if at_next else None, start=len(ids) - 1 if at_next else None,
                                sampling_temperature=(body.model_extra or {}).get("temperature"))
        except BadRequest as e:
            raise renamed(e, _NAMES) from None
        if mt == 1 and kl is not None:
            req.next_top = max(kl, 1)  # the generated (greedy) token is the top-1
            req.next_candidates = at_next
        entries += (req.length - 1) * (plp + 1) if plp is not None else 0
        reqs.append(req)
    if limits.max_prompt_logprobs_entries is not None and entries > limits.max_prompt_logprobs_entries:
        raise BadRequest(f"the prompts' logprobs make {entries} JSON entries, more than max_prompt_logprobs_entries="
                         f"{limits.max_prompt_logprobs_entries}; ask for fewer, or use POST /inference/v1/generate "
                         "with prompt_logprob_topk (binary arrays)", "prompt_logprobs")
    # The prompts live on as the requests' arrays: their JSON lists and any large ignored field
    # are let go here, as the native endpoint lets its body go (the byte budget stops counting them).
    body.prompt = []
    body.model_extra.clear()
    return ParsedCompletion(body, reqs, rid, plp, kl)


def _logprobs_k(body: CompletionRequest, name: str, limits: Limits) -> int | None:
    """``logprobs`` / ``prompt_logprobs`` as a number of top entries: -1 is the whole
    vocabulary (vLLM's), within ``max_logprobs`` as vLLM's request check has it."""
    v = getattr(body, name)
    if v is None:
        return None
    if v < -1:
        raise BadRequest(f"`{name}` must be a positive value or -1, got {v}", name)
    k = limits.vocab_size if v == -1 else v
    cap = min(limits.max_logprobs, limits.vocab_size)
    if k > cap:
        raise BadRequest(f"Requested {name.replace('_', ' ')} of {k}, which is greater than max allowed: {cap} "
                         "(max_logprobs)", name)
    return k


class _Names:
    """Token strings: ``token_id:<id>``, the tokenizer's piece, or None (no tokenizer)."""

    def __init__(self, tok: Tokenizer | None, as_ids: bool, ids: np.ndarray) -> None:
        self.as_ids = as_ids
        self.pieces = tok.pieces(np.unique(ids).tolist()) if tok is not None and not as_ids else None

    def __call__(self, i: int) -> str | None:
        if self.as_ids:
            return f"token_id:{i}"
        return None if self.pieces is None else self.pieces[i]

    def json_table(self, ids: set[int]) -> dict[int, bytes] | None:
        """Each id's name as JSON bytes (None: every name is null)."""
        if self.as_ids:
            return {i: b'"token_id:%d"' % i for i in ids}
        if self.pieces is None:
            return None
        return {i: orjson.dumps(self.pieces[i]) for i in ids}


def _lp(x: float) -> float:
    return x if x > NEG_INF_JSON else NEG_INF_JSON  # (-inf and NaN-free: JSON has no infinity)


def prompt_logprobs_json(req: ScoreRequest, res: ScoreResult, k: int, name: _Names) -> bytes:
    """``choices[i].prompt_logprobs`` as JSON bytes: ``null``, then per position
    ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the actual token first, then the top-k
    by rank (without repeating the actual token, which then has its top-k rank). Built
    ``PLP_SLICE`` positions at a time from byte templates: orjson formats a slice's floats in
    one call (the same digits it gives a dict's floats) and each entry is one bytes formatting,
    ~4x faster than building a dict per entry and about a fifth of a microsecond of GIL per
    entry."""
    n = req.length
    toks = req.token_ids.tolist()
    tok_json = name.json_table(set(toks) | set(np.unique(res.plp_topk_ids[:n - 1, :k]).tolist()) if n > 1 else set())
    item = b'"%d":{"logprob":%b,"rank":%d,"decoded_token":' + (b"%b}" if tok_json is not None else b"null}")
    head, item = b"{" + item, b"," + item
    parts = [b"[null"]
    for a in range(1, n, PLP_SLICE):
        b = min(a + PLP_SLICE, n)
        rows = slice(a - 1, b - 1)
        # -inf as -9999.0 (JSON has no infinity); one orjson call formats all of a slice's floats
        act = orjson.dumps(np.maximum(res.plp_token_logprob[rows], NEG_INF_JSON).tolist())[1:-1].split(b",")
        rk = res.plp_token_rank[rows].tolist()
        ids = res.plp_topk_ids[rows, :k].tolist()
        vals = orjson.dumps(np.maximum(res.plp_topk_logprobs[rows, :k], NEG_INF_JSON).tolist())[2:-2].split(b"],[") \
            if k else [b""] * (b - a)
        for j in range(a, b):
            t0, i = toks[j], j - a
            fl = vals[i].split(b",") if k else ()
            # the actual token among the top-k: its top-k entry (vLLM's dict keeps the later one)
            at = ids[i].index(t0) if t0 in ids[i] else -1
            a_lp, a_rk = (act[i], rk[i]) if at < 0 else (fl[at], at + 1)
            if tok_json is None:  # every name is null: the templates hold it
                out = [b",", head % (t0, a_lp, a_rk)]
                out += [item % (t, f, r) for r, (t, f) in enumerate(zip(ids[i], fl), start=1) if t != t0]
            else:
                out = [b",", head % (t0, a_lp, a_rk, tok_json[t0])]
                out += [item % (t, f, r, tok_json[t]) for r, (t, f) in enumerate(zip(ids[i], fl), start=1) if t != t0]
            out.append(b"}")
            parts.append(b"".join(out))
        time.sleep(0)  # let the engine thread and the event loop run
    parts.append(b"]")
    return b"".join(parts)


def _position_top(token: int, lp: float, ids: list[int], vals: list[float], k: int | None) -> tuple[float, dict]:
    """One position's OpenAI ``token_logprobs`` value and ``top_logprobs`` as vLLM builds them:
    the entry dict by id (the token, then the top ids, a top id replacing the token's own entry
    where they meet), its first ``k + 1`` entries (None: all, as with ``logprob_token_ids``)
    keyed by token string (the later of two ids with one string wins, as in vLLM's dict
    comprehension). ``ids``/``vals``: the position's top (or given) ids and their logprobs (a
    ``_Names`` maps the keys later)."""
    by_id = {token: lp}
    for i, v in zip(ids, vals):
        by_id[i] = v
    items = list(by_id.items())
    return by_id[token], dict(items if k is None else items[:k + 1])


def _openai_logprobs(req: ScoreRequest, res: ScoreResult, k: int, prompt_k: int | None, echo: bool, mt: int,
                     name: _Names, given: list[int] | None = None) -> dict[str, list]:
    """OpenAI's logprobs of the returned tokens: the prompt's (with echo; None at position 0;
    its entries are the ``prompt_logprobs`` ones, ``prompt_k`` wide) and the greedy token's
    (the top ``k``), at most ``k + 1`` alternatives each, the token itself first. With
    ``given`` (``logprob_token_ids``), the greedy token's alternatives are those ids (the
    request's ``next_candidates`` row) and no position is cut to ``k + 1``, as in vLLM."""
    tokens, token_lps, tops = [], [], []
    positions = list(range(req.length)) if echo else []
    toks = req.token_ids.tolist()
    rows = [(j, toks[j], j - 1, prompt_k or 0) for j in positions]
    if mt and res.next_token is not None:
        # the next token's distribution (``next_top``: its top-1 is the greedy token, also with k = 0)
        rows.append((None, res.next_token, req.length - 1, max(k, 1)))
    for j, t, row, width in rows:
        tokens.append(name(t))
        if j == 0:
            token_lps.append(None)
            tops.append(None)
            continue
        ids, vals = res.plp_topk_ids[row, :width].tolist(), res.plp_topk_logprobs[row, :width].tolist()
        own = float(res.plp_token_logprob[row]) if j is not None else vals[ids.index(t)] if t in ids else vals[0]
        if j is None and given is not None:
            ids, vals = given, res.token_id_logprobs[-1].tolist()
        lp, top = _position_top(t, own, ids, vals, None if given is not None else k)
        token_lps.append(_lp(lp))
        named: dict[str | None, float] = {}
        for i, v in top.items():
            named[name(i)] = _lp(v)
        tops.append(named)
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s or "")
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def build_completion(parsed: ParsedCompletion, results: list[ScoreResult], model: str,
                     tok: Tokenizer | None) -> bytes:
    """The JSON bytes of vLLM's ``CompletionResponse``; each choice's (large) prompt_logprobs
    is spliced in as built by ``prompt_logprobs_json``."""
    body = parsed.body
    mt = 1 if body.max_tokens is None else body.max_tokens
    as_ids = bool(body.return_tokens_as_token_ids)
    choices: list[bytes] = []
    prompt_tokens = cached = 0
    for i, (req, res) in enumerate(zip(parsed.reqs, results)):
        out_ids = [res.next_token] if mt and res.next_token is not None else []
        used = np.concatenate([req.token_ids, out_ids, body.logprob_token_ids or [],
                               res.plp_topk_ids.reshape(-1) if res.plp_topk_ids is not None else []]).astype(np.int64)
        names = _Names(tok, as_ids, used)  # logprobs' tokens
        text = ""
        if tok is not None:  # (vLLM leaves the echoed prompt out of text when it returns token ids)
            text = tok.decode((req.token_ids.tolist() if body.echo and not body.return_token_ids else []) + out_ids)
        choice: dict[str, Any] = {
            "index": i, "text": text,
            "logprobs": None if parsed.logprobs_k is None else _openai_logprobs(
                req, res, parsed.logprobs_k, parsed.prompt_k, bool(body.echo), mt, names, body.logprob_token_ids),
            "finish_reason": "length", "stop_reason": None,
            "prompt_token_ids": req.token_ids.tolist() if body.return_token_ids else None,
            "token_ids": out_ids if body.return_token_ids else None,
        }
        head = orjson.dumps(choice)[:-1]
        plp = b"null"
        if parsed.prompt_k is not None:  # decoded_token: the tokenizer's text (vLLM's detokenizer), never token_id:
            decoded = names if not as_ids else _Names(tok, False, used)
            plp = prompt_logprobs_json(req, res, parsed.prompt_k, decoded)
        choices.append(head + b',"prompt_logprobs":' + plp + b"}")
        prompt_tokens += req.length
        cached += res.cached_tokens
    n_out = mt * len(parsed.reqs)
    head = orjson.dumps({
        "id": parsed.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out,
                  "prompt_tokens_details": {"cached_tokens": cached}},
        "system_fingerprint": None, "kv_transfer_params": None})
    return head[:-1] + b',"choices":[' + b",".join(choices) + b"]}"
