"""The request side of ``POST /v1/completions`` (``completions`` builds the answer): the body
as vLLM's OpenAI server takes it, and the engine requests its prompts make: text or ids, cut as
vLLM's ``truncate_prompt_tokens`` cuts them, with the prompt's and the generated token's
logprobs asked, under vLLM's refusals."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from teacher_server.engine.request import ScoreRequest
from teacher_server.server.parsing import as_model, json_object, refuse_long_prompt
from teacher_server.server.protocol import _FF, IgnoredSampling, IntList
from teacher_server.server.tokenizer import Tokenizer, require
from teacher_server.validation import BadRequest, Limits, build_request, check_batch, check_in_vocab, check_n, renamed


class CompletionRequest(IgnoredSampling):
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
    skip_special_tokens: StrictBool = Field(
        True, description="vLLM's: the generated token's `text` leaves special tokens out (an echoed prompt keeps "
                          "them).")
    n: StrictInt | StrictFloat | None = Field(1, description="1 only (1.0 too, as vLLM reads it).")
    stream: StrictBool | None = Field(False, description="false only.")
    truncate_prompt_tokens: StrictInt | None = Field(
        None, description="vLLM's: score only the last k tokens of each prompt (the first k with `truncation_side` "
                          "right); -1: max_model_len - max_tokens, also the most k may be. A text prompt keeps its "
                          "special tokens within the k.")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM's: where `truncate_prompt_tokens` cuts (left, the default: the prompt's start).")
    suffix: StrictStr | None = Field(None, description="Not supported (vLLM's answer too): 400.")
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = Field(None, description="Isolates prefix-cache entries between tenants.")
    priority: StrictInt = 0
    # more of vLLM's sampling fields than IgnoredSampling's, equally without effect; its seed bounded as vLLM's
    best_of: int | None = None
    length_penalty: float | None = None
    user: str | None = None
    use_beam_search: bool | None = None
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)] | None = None


@dataclass
class ParsedCompletion:
    body: CompletionRequest
    reqs: list[ScoreRequest]
    request_id: str
    prompt_k: int | None  # the k of the prompt's logprobs (``prompt_logprobs``, or ``logprobs`` with echo)
    logprobs_k: int | None  # ``logprobs`` (-1 resolved to the vocabulary)
    # echo of text prompts: each prompt as sent, which vLLM echoes (not its ids decoded: no added
    # special tokens, and the whole text where truncate_prompt_tokens cut the ids)
    echo_texts: list[str] | None = None
    header_named: bool = False  # X-Request-Id named the call

    @property
    def client_id(self) -> str | None:
        """``request_id`` where the client named the call (X-Request-Id or the body's), else None."""
        return self.request_id if self.header_named or self.body.request_id is not None else None


def _is_text(prompt: object) -> bool:
    """A text prompt, or a batch of them (not token ids)."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))


def _token_prompts(body: CompletionRequest, tok: Tokenizer | None, keep: int | None) -> list[list[int]]:
    """The prompts' ids, each cut to ``keep`` tokens where that is set (vLLM's truncation: the
    cut side's tokens go; a text prompt's special tokens count within ``keep``)."""
    p, side = body.prompt, body.truncation_side or "left"
    if _is_text(p):
        t = require(tok, "a text prompt")
        texts = [p] if isinstance(p, str) else p
        return [t.encode(x, body.add_special_tokens, keep, side) for x in texts]
    prompts = p if isinstance(p, list) and p and isinstance(p[0], list) else [p]
    if keep is None:
        return prompts
    return [ids if len(ids) <= keep else ids[-keep:] if side == "left" else ids[:keep] for ids in prompts]


def _truncation(body: CompletionRequest, limits: Limits, max_tokens: int) -> int | None:
    """``truncate_prompt_tokens`` as the number of tokens kept, under vLLM's rule: at most
    ``max_model_len - max_tokens`` (the room left for the output), which -1 stands for; None:
    the prompts as sent."""
    k = body.truncate_prompt_tokens
    if k is None:
        return None
    cap = limits.max_model_len - max_tokens
    if k == -1:
        return cap
    if k < 1:
        raise BadRequest(f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens")
    if k > cap:
        raise BadRequest(f"truncate_prompt_tokens={k} cannot be greater than max_model_len - max_tokens = {cap}",
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
    try:
        refuse_long_prompt(raw, "completions", limits.max_model_len)
        obj = json_object(raw) if obj is None else obj
        return _parse_completion(as_model(obj, CompletionRequest), limits, served, tok, aliases, header_request_id)
    except BadRequest as e:
        e.request_id = refused_call_id(obj, header_request_id)
        raise


def refused_call_id(obj: dict | None, header_request_id: str | None) -> str | None:
    """The id the access line names a refused call by, as the completion's id would be:
    ``cmpl-`` and X-Request-Id or the body's ``request_id`` (``obj``: None where not parsed)."""
    rid = header_request_id if header_request_id is not None else (obj or {}).get("request_id")
    return f"cmpl-{rid}" if isinstance(rid, str) else None


_NAMES = {"token_ids": "prompt", "sampling_params.prompt_logprob_token_ids": "logprob_token_ids"}


def _parse_completion(body: CompletionRequest, limits: Limits, served: str, tok: Tokenizer | None,
                      aliases: tuple[str, ...], header_request_id: str | None) -> ParsedCompletion:
    if body.model is not None and body.model != served and body.model not in aliases:
        raise BadRequest(f"The model `{body.model[:200]}` does not exist.", "model", status=404)
    if body.stream:
        raise BadRequest("stream=true is not supported: this server scores, it does not stream", "stream")
    check_n(body.n, "n")
    if body.suffix is not None:
        raise BadRequest("suffix is not currently supported", "suffix")
    mt = 1 if body.max_tokens is None else body.max_tokens
    keep = _truncation(body, limits, mt) if mt in (0, 1) else None  # (another max_tokens: build_request's 400)
    given = body.logprob_token_ids
    if given is not None:  # (vLLM's checks of it, in its words)
        if not given:
            raise BadRequest("`logprob_token_ids` must not be an empty list.", "logprob_token_ids")
        check_in_vocab(given, limits, "logprob_token_ids")  # (whether or not this request scores them)
        if body.echo and body.max_tokens == 0:
            raise BadRequest("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                             "output tokens are generated.", "logprob_token_ids")
        if body.logprobs is None:
            raise BadRequest("when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids")
    kl, kp = (_logprobs_k(body, name, limits) for name in ("logprobs", "prompt_logprobs"))
    if body.logprobs is not None and not body.return_tokens_as_token_ids:
        require(tok, "logprobs with token strings", ("send the prompt as token ids and " if _is_text(body.prompt)
                                                     else "") + "set return_tokens_as_token_ids=true")
    p = body.prompt
    check_batch(len(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else 1, limits, "prompt")
    prompts = _token_prompts(body, tok, keep)
    if not prompts:
        raise BadRequest("prompt must not be empty", "prompt")
    rid = header_request_id if header_request_id is not None else body.request_id
    rid = f"cmpl-{rid if rid is not None else uuid.uuid4().hex}"
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
    echo_texts = ([p] if isinstance(p, str) else list(p)) if body.echo and _is_text(p) else None
    body.prompt = []
    body.model_extra.clear()
    body.logit_bias = body.stop_token_ids = body.allowed_token_ids = None
    return ParsedCompletion(body, reqs, rid, plp, kl, echo_texts, header_request_id is not None)


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
