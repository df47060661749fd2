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
batch (a 400 beyond: the native endpoint returns the same numbers as binary arrays). The request
side (the body, its prompts and their truncation) is ``completion_request``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson

from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.server.completion_request import CompletionRequest, ParsedCompletion, parse_completion
from teacher_server.server.responses import NEG_INF_JSON
from teacher_server.server.tokenizer import Tokenizer

__all__ = ["CompletionRequest", "ParsedCompletion", "build_completion", "parse_completion", "prompt_logprobs_json"]

PLP_SLICE = 512  # positions of prompt_logprobs serialised at a time


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
    """An OpenAI ``logprobs`` value as vLLM writes it: at least -9999.0 (-inf and NaN-free)."""
    return x if x > NEG_INF_JSON else NEG_INF_JSON


def _finite(a: np.ndarray) -> np.ndarray:
    """``prompt_logprobs`` values as vLLM writes them: -inf (any non-finite) as -9999.0."""
    return np.where(np.isfinite(a), a, NEG_INF_JSON)


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
        # -inf as -9999.0 (JSON has no infinity; vLLM's prompt_logprobs replace it alone, a finite
        # value below -9999 is kept); one orjson call formats all of a slice's floats
        act = orjson.dumps(_finite(res.plp_token_logprob[rows]).tolist())[1:-1].split(b",")
        rk = res.plp_token_rank[rows].tolist()
        ids = res.plp_topk_ids[rows, :k].tolist()
        vals = orjson.dumps(_finite(res.plp_topk_logprobs[rows, :k]).tolist())[2:-2].split(b"],[") \
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
        if tok is not None:  # vLLM's: the echoed prompt (as sent, or its ids decoded; left out when it returns
            # token ids), then the generated token's text as its incremental detokenizer gives it
            # (the context: at most the prompt's last 23 ids, all vLLM's detokenizer looks at)
            text = tok.continuation(req.token_ids[-23:].tolist(), out_ids, body.skip_special_tokens) if out_ids else ""
            if body.echo and not body.return_token_ids:
                text = (parsed.echo_texts[i] if parsed.echo_texts is not None
                        else tok.decode(req.token_ids.tolist())) + text
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
