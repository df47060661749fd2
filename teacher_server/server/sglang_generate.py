"""``POST /generate`` as SGLang's native endpoint answers it, for what teacher scoring uses:
``input_ids`` (one list or a batch; ``text`` where the checkpoint has a tokenizer),
``sampling_params.max_new_tokens`` 0 or 1, ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num``, ``token_ids_logprob`` (each a value or a per-prompt list, as SGLang
takes them), ``return_text_in_logprobs``. The answer is SGLang's: ``text``, ``output_ids``,
``meta_info`` with ``id``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``e2e_latency``, ``weight_version`` ("default": weights never change here),
``total_retractions`` (0: nothing is retracted) and, with ``return_logprob``:

- ``input_token_logprobs``: ``[logprob, token_id, text]`` per input position from
  ``logprob_start_len`` (``-1``, the default: the last input position, none of them with
  ``max_new_tokens`` 0; from the input's length on: none with 0, 400 with 1);
  the first entry's logprob is ``None`` whatever the start, as SGLang pads it (its scheduler
  takes the first returned position's logprob as not computed);
- ``input_top_logprobs`` (``top_logprobs_num`` > 0): per position the top-k as such triples
  (``None`` at the first position);
- ``input_token_ids_logprobs`` (``token_ids_logprob``): per position the given ids' triples;
- ``output_token_logprobs`` / ``output_top_logprobs`` / ``output_token_ids_logprobs`` for the
  greedy token when ``max_new_tokens`` is 1 (the given ids scored at the last position too:
  the engine's ``next_candidates``).

``text`` of a triple is ``None`` unless ``return_text_in_logprobs`` (then the checkpoint's
tokenizer decodes it). ``-inf`` is written as -9999.0 (JSON has no infinity). The JSON is built
with orjson and bounded by ``max_prompt_logprobs_entries`` over the batch, as
``/v1/completions`` is."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.server.parsing import as_model, json_object, refuse_long_prompt
from teacher_server.server.protocol import _FF, IntList
from teacher_server.server.responses import finite_json as _lp  # (-inf as -9999.0, as vLLM writes it)
from teacher_server.server.tokenizer import Tokenizer, require
from teacher_server.validation import (
    BadRequest,
    Limits,
    RowTargets,
    build_request,
    check_batch,
    check_in_vocab,
    check_n,
    check_priority,
    renamed,
)

_Many = Annotated[list[StrictInt], _FF]


class SGLangGenerateRequest(BaseModel):
    """Body of ``POST /generate`` (SGLang's ``GenerateReqInput``). Per-prompt fields take a value
    for every prompt or a list with one per prompt. Other SGLang fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    input_ids: IntList | Annotated[list[IntList], _FF] | None = Field(
        None, description="Token ids of one prompt, or a batch (a list of lists).")
    text: StrictStr | Annotated[list[StrictStr], _FF] | None = Field(
        None, description="Text, where the checkpoint has a tokenizer.json (one of text / input_ids).")
    sampling_params: dict[str, Any] | Annotated[list[dict[str, Any]], _FF] | None = Field(
        None, description="`max_new_tokens` 0 or 1 (absent: 1); the other sampling fields do not change scores.")
    return_logprob: StrictBool | Annotated[list[StrictBool], _FF] | None = None
    logprob_start_len: StrictInt | _Many | None = Field(
        None, description="First input position with logprobs; -1 (default): none of the input's.")
    top_logprobs_num: StrictInt | _Many | None = Field(None, description="Top-k per position (0: none).")
    token_ids_logprob: IntList | Annotated[list[IntList], _FF] | None = Field(
        None, description="Ids whose logprobs are returned at every input position (one list, or one per prompt).")
    return_text_in_logprobs: StrictBool = False
    rid: StrictStr | Annotated[list[StrictStr], _FF] | None = None
    stream: StrictBool = False
    priority: StrictInt | None = Field(
        None, description="SGLang's: a larger value runs earlier (its default order); the queue here runs lower "
                          "values earlier, so it is negated; within -priority_limit..priority_limit.")


@dataclass
class _Item:
    """One prompt's asks."""

    logprob: bool
    start: int  # first input position returned (len(ids): none)
    top: int
    ids: list[int] | None
    max_new: int
    rid: str
    skip_special: bool = True  # sampling_params.skip_special_tokens (the generated text's)


@dataclass
class ParsedSGLang:
    body: SGLangGenerateRequest
    reqs: list[ScoreRequest]
    items: list[_Item]
    batch: bool

    @property
    def request_id(self) -> str:
        """The id the access line names the call by: its prompt's, a batch's first."""
        return self.items[0].rid

    @property
    def client_id(self) -> str | None:
        """``request_id`` where the body named it (``rid``), else None (an id of ours)."""
        rid = self.body.rid
        return self.request_id if (rid[0] if isinstance(rid, list) and rid else rid) else None


def _per(value: Any, i: int, n: int, name: str, nested: bool = False) -> Any:
    """The value of prompt ``i`` of ``n``: a list with one per prompt, or one for all."""
    if isinstance(value, list) and (not nested or (value and isinstance(value[0], list))):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts", name)
        return value[i]
    return value


def parse_sglang(raw: bytes, limits: Limits, served: str, tok: Tokenizer | None,
                 aliases: tuple[str, ...] = (), header_request_id: str | None = None,
                 obj: dict | None = None) -> ParsedSGLang:
    """JSON bytes -> one engine request per prompt; BadRequest otherwise. (SGLang names a
    request by its body's ``rid`` alone: ``header_request_id`` is not read.) ``obj``: the body's
    JSON object where it was parsed already (``Teachers.pick``)."""
    refuse_long_prompt(raw, "sglang-generate", limits.max_model_len)
    obj = json_object(raw) if obj is None else obj
    try:
        return _parse_sglang(as_model(obj, SGLangGenerateRequest), limits, tok)
    except BadRequest as e:
        e.request_id = refused_call_id(obj)
        raise


def refused_call_id(obj: dict) -> str | None:
    """The id the access line names a refused call by, as a success names it: the first
    prompt's ``rid`` (None where the body gives none)."""
    rid, many = obj.get("rid"), obj.get("input_ids") if obj.get("text") is None else obj.get("text")
    if isinstance(rid, list):
        rid = rid[0] if rid else None
    elif isinstance(rid, str) and isinstance(many, list) and many and isinstance(many[0], str | list):
        rid = f"{rid}_0"  # (SGLang's expansion of one rid over a batch)
    return rid if isinstance(rid, str) and rid else None


# build_request's names of the native request's fields -> this endpoint's (its sampling fields stay in
# sampling_params)
_NAMES = {"token_ids": "input_ids"} | {f"{pre}{ours}": theirs for pre in ("sampling_params.", "") for ours, theirs in (
    ("prompt_logprob_token_ids", "token_ids_logprob"), ("prompt_logprob_start", "logprob_start_len"),
    ("prompt_logprob_topk", "top_logprobs_num"), ("max_tokens", "sampling_params.max_new_tokens"))}


def _parse_sglang(body: SGLangGenerateRequest, limits: Limits, tok: Tokenizer | None) -> ParsedSGLang:
    if body.stream:
        raise BadRequest("stream=true is not supported: this server scores, it does not stream", "stream")
    if (body.input_ids is None) == (body.text is None):
        raise BadRequest("give exactly one of input_ids and text", "input_ids")
    many = body.text if body.text is not None else body.input_ids
    check_batch(len(many) if isinstance(many, list) and many and isinstance(many[0], str | list) else 1, limits,
                "input_ids" if body.text is None else "text")
    if body.text is not None:
        t = require(tok, "text")
        batch = isinstance(body.text, list)
        prompts = [t.encode(x) for x in (body.text if batch else [body.text])]
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
    if not prompts:
        raise BadRequest("input_ids must not be empty", "input_ids")
    if body.return_text_in_logprobs:
        require(tok, "return_text_in_logprobs", "leave return_text_in_logprobs false (the triples' text is then null)")
    n = len(prompts)
    cap = min(limits.max_logprobs, limits.vocab_size)
    check_priority(body.priority or 0, limits)  # (as sent: it is negated below)
    rid = body.rid
    if isinstance(rid, str) and batch:  # (SGLang's own expansion of one rid over a batch)
        rid = [f"{rid}_{i}" for i in range(n)]
    reqs, items, entries = [], [], 0
    for i, ids in enumerate(prompts):
        sp = _per(body.sampling_params, i, n, "sampling_params") or {}
        mn = sp.get("max_new_tokens")
        mn = 1 if mn is None else mn  # (null: SGLang's "no limit", which this server's 0 or 1 makes 1)
        if isinstance(mn, bool) or not isinstance(mn, int) or mn not in (0, 1):
            raise BadRequest(f"sampling_params.max_new_tokens must be 0 or 1 (this server scores, it does not "
                             f"generate); got {mn!r}", "sampling_params.max_new_tokens")
        check_n(sp.get("n"), "sampling_params.n")
        skip = sp.get("skip_special_tokens")
        if skip is not None and not isinstance(skip, bool):
            raise BadRequest(f"sampling_params.skip_special_tokens must be a boolean, got {skip!r}",
                             "sampling_params.skip_special_tokens")
        want = bool(_per(body.return_logprob, i, n, "return_logprob"))
        start = _per(body.logprob_start_len, i, n, "logprob_start_len")
        start = -1 if start is None else start
        top = _per(body.top_logprobs_num, i, n, "top_logprobs_num") or 0
        tids = _per(body.token_ids_logprob, i, n, "token_ids_logprob", nested=True)
        if start < -1:
            raise BadRequest(f"logprob_start_len must be >= -1, got {start}", "logprob_start_len")
        if not 0 <= top <= cap:
            raise BadRequest(f"top_logprobs_num must be in [0, {cap}] (max_logprobs), got {top}", "top_logprobs_num")
        if tids is not None and not tids:
            tids = None
        if tids is not None:  # (range-checked whether or not this prompt returns logprobs)
            check_in_vocab(tids, limits, "token_ids_logprob")
        length = len(ids)
        # SGLang's scheduler: -1 is the last input position (a prefill-only request's, max_new_tokens 0: none), and
        # a start at or past the input's length is refused unless the request is prefill-only (then: none)
        if want and mn == 1 and start >= length:
            raise BadRequest(f"logprob_start_len ({start}) must be less than the number of input tokens ({length}) "
                             "when max_new_tokens is 1", "logprob_start_len")
        first = (length - mn) if start == -1 else min(start, length)  # the first input position returned
        # Position ``first`` is returned without logprobs (as SGLang does); position p > first is scored
        # by causal row p - 1, so the rows (and the given ids as shared candidates) start at ``first``.
        rows = want and first < length - 1
        # the given ids at the generated token's position too (``output_token_ids_logprobs``)
        nxt = want and mn == 1 and tids is not None
        try:
            req = build_request(token_ids=ids, limits=limits, max_tokens=mn,
                                start=first if rows else length - 1 if nxt else None,
                                candidates=tids if (rows or nxt) and tids is not None else None,
                                targets=RowTargets(topk=top or None, actual=True) if rows else None,
                                sampling_temperature=sp.get("temperature"), priority=-(body.priority or 0),
                                request_id=(_per(rid, i, n, "rid") if rid is not None else None)
                                or f"{uuid.uuid4().hex}")
        except BadRequest as e:
            raise renamed(e, _NAMES, "sampling_params.") from None
        if want and mn == 1:
            req.next_top = max(top, 1)
            req.next_candidates = nxt
        entries += (length - first) * (top + 1 + len(tids or ())) if want else 0
        reqs.append(req)
        items.append(_Item(want, first, top, tids, mn, req.request_id, skip is not False))
    if limits.max_prompt_logprobs_entries is not None and entries > limits.max_prompt_logprobs_entries:
        raise BadRequest(f"the requested logprobs make {entries} JSON entries, more than max_prompt_logprobs_entries="
                         f"{limits.max_prompt_logprobs_entries}; ask for fewer, or use POST /inference/v1/generate "
                         "with prompt_logprob_topk (binary arrays)", "top_logprobs_num")
    # (as parse_completion: the prompts and any large ignored field are let go here)
    body.input_ids = body.text = body.sampling_params = None
    body.model_extra.clear()
    return ParsedSGLang(body, reqs, items, batch)


def _meta_logprobs(req: ScoreRequest, res: ScoreResult, it: _Item, text: dict[int, str] | None) -> dict[str, Any]:
    """The ``meta_info`` logprob fields of one prompt. The first position returned
    (``it.start``) has none; position p after it is scored by the request's row p - 1 - start
    (its rows begin at causal row ``req.start`` = ``it.start``)."""
    name = (lambda i: text[i]) if text is not None else (lambda i: None)
    toks = req.token_ids.tolist()
    pos = range(it.start, req.length)
    row = [p - 1 - req.start for p in pos]  # (the first position's is never read)
    first = it.start
    out: dict[str, Any] = {}
    act = res.actual_logprobs.tolist() if res.actual_logprobs is not None else []
    out["input_token_logprobs"] = [[None if p == first else _lp(act[r]), toks[p], name(toks[p])]
                                   for p, r in zip(pos, row)]
    nxt = res.next_token if it.max_new and res.next_token is not None else None
    last_ids = last_vals = None
    if nxt is not None:  # the next token's distribution (``next_top``)
        last_ids, last_vals = res.plp_topk_ids[-1].tolist(), res.plp_topk_logprobs[-1].tolist()
        g = last_vals[last_ids.index(nxt)] if nxt in last_ids else last_vals[0]
        out["output_token_logprobs"] = [[_lp(g), nxt, name(nxt)]]
    else:
        out["output_token_logprobs"] = []
    if it.top > 0:
        ids = res.topk_ids.tolist() if res.topk_ids is not None else []
        vals = res.topk_logprobs.tolist() if res.topk_logprobs is not None else []
        out["input_top_logprobs"] = [None if p == first else [[_lp(v), t, name(t)] for t, v in zip(ids[r], vals[r])]
                                     for p, r in zip(pos, row)]
        out["output_top_logprobs"] = [] if nxt is None else [
            [[_lp(v), t, name(t)] for t, v in zip(last_ids[:it.top], last_vals[:it.top])]]
    if it.ids is not None:
        m = res.token_id_logprobs.tolist() if res.token_id_logprobs is not None else []
        out["input_token_ids_logprobs"] = [None if p == first else [[_lp(v), t, name(t)] for t, v in zip(it.ids, m[r])]
                                           for p, r in zip(pos, row)]
        # (the generated token's: the request's last candidate row, ``next_candidates``)
        out["output_token_ids_logprobs"] = [] if nxt is None else [
            [[_lp(v), t, name(t)] for t, v in zip(it.ids, m[-1])]]
    return out


def build_sglang(parsed: ParsedSGLang, results: list[ScoreResult], model: str, tok: Tokenizer | None) -> bytes:
    """SGLang's answer: one object per prompt (a list for a batch)."""
    outs = []
    for req, res, it in zip(parsed.reqs, results, parsed.items):
        out_ids = [res.next_token] if it.max_new and res.next_token is not None else []
        meta: dict[str, Any] = {
            "id": it.rid, "finish_reason": {"type": "length", "length": it.max_new},
            "prompt_tokens": req.length, "completion_tokens": len(out_ids), "cached_tokens": res.cached_tokens,
            "weight_version": "default", "total_retractions": 0,
            "e2e_latency": max(res.finished_at - req.arrival, 0.0)}
        if it.logprob:
            text = None
            if parsed.body.return_text_in_logprobs and tok is not None:
                used = [req.token_ids, out_ids]
                if res.plp_topk_ids is not None:
                    used.append(res.plp_topk_ids.reshape(-1))
                if it.ids is not None:
                    used.append(it.ids)
                text = tok.pieces(np.unique(np.concatenate([np.asarray(u, dtype=np.int64) for u in used])).tolist())
            meta.update(_meta_logprobs(req, res, it, text))
        # (SGLang's detokenizer: the generated ids decoded after the prompt's last 5)
        gen = tok.continuation(req.token_ids[-5:].tolist(), out_ids, it.skip_special, last=5) if tok and out_ids else ""
        outs.append({"text": gen, "output_ids": out_ids,
                     "meta_info": meta})
        time.sleep(0)  # let the engine thread and the event loop run between prompts
    return orjson.dumps(outs if parsed.batch else outs[0])
