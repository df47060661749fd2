"""In-process Python API, shaped like vLLM's ``LLM`` so teacher-scoring code written for
vLLM runs with only its import changed::

    from teacher_server import LLM, SamplingParams, TokensPrompt

    out = LLM(model_dir).generate(
        TokensPrompt(prompt_token_ids=ids),
        SamplingParams(max_tokens=1, prompt_logprob_token_ids=cands, prompt_logprob_start=len(prompt) - 1),
    )[0].prompt_token_id_logprobs          # np.ndarray [rows, K] float32
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from teacher_server.candidates import InvalidIds, candidate_ids
from teacher_server.config import Config
from teacher_server.did_you_mean import did_you_mean
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreResult, prompt_logprob_entries
from teacher_server.targets import union_columns
from teacher_server.validation import BadRequest, Limits, RowTargets, build_request, check_n, integer

_CANDIDATES = "sampling_params.prompt_logprob_token_ids"
# vLLM's other SamplingParams fields, the names the HTTP endpoint accepts and ignores
# (teacher_server/server/protocol.py; tests/test_llm_inputs.py keeps the two lists equal). A name outside
# them is a typo whose silent acceptance would score the wrong rows.
VLLM_IGNORED_FIELDS = frozenset({
    "truncate_prompt_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "bad_words", "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "logit_bias", "allowed_token_ids", "extra_args", "output_kind", "structured_outputs", "guided_decoding", "n",
    "best_of", "flat_logprobs", "logits_processors", "skip_reading_prefix_cache", "skip_clone"})
_SCORING_FIELDS = ("max_tokens", "prompt_logprob_token_ids", "prompt_logprob_start", "prompt_logprobs",
                   "prompt_logprob_topk", "prompt_logprob_union", "prompt_logprob_actual", "prompt_logprob_tail",
                   "prompt_logprob_logsumexp", "prompt_logprob_temperature")


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    cache_salt: str


_PROMPT_KEYS = ("prompt_token_ids", "cache_salt")
# vLLM's other TokensPrompt keys: text kept beside the ids, and multimodal inputs a text teacher has no use for
_PROMPT_IGNORED = frozenset({"prompt", "token_type_ids", "multi_modal_data", "mm_processor_kwargs",
                             "multi_modal_uuids"})
# vLLM's LLM.generate keywords beside sampling_params and use_tqdm: none changes a score here
_GENERATE_IGNORED = frozenset({"lora_request", "prompt_adapter_request", "guided_options_request", "priority",
                               "tokenization_kwargs"})
_SP = "sampling_params."


def _whole(value: Any, name: str, none: bool = True) -> int | None:
    """``value`` where it is an integer (a Python or numpy one, not a bool) or None (``none``);
    BadRequest naming the field otherwise, as the HTTP endpoint answers 1.5 or "4"."""
    return None if value is None and none else integer(value, _SP + name)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise BadRequest(f"{name} must be true or false, got {type(value).__name__} {value!r:.40}", _SP + name)
    return bool(value)


class SamplingParams:
    """The vLLM fields that matter for scoring; vLLM's other sampling fields are accepted
    as keyword arguments and do not change the scores. Any other name raises TypeError naming
    it and the closest valid name (``prompt_logprob_strat`` is not ``prompt_logprob_start``)."""

    def __init__(self, max_tokens: int = 1, prompt_logprob_token_ids: Any = None,
                 prompt_logprob_start: int | None = None, prompt_logprobs: int | None = None,
                 prompt_logprob_topk: int | None = None, prompt_logprob_union: bool = False,
                 prompt_logprob_actual: bool = False, prompt_logprob_tail: bool = False,
                 prompt_logprob_logsumexp: bool = False, prompt_logprob_temperature: float | None = None,
                 **ignored: Any) -> None:
        unknown = sorted(set(ignored) - VLLM_IGNORED_FIELDS)
        if unknown:
            valid = [*_SCORING_FIELDS, *sorted(VLLM_IGNORED_FIELDS)]
            raise TypeError(f"SamplingParams got an unknown field {unknown[0]!r}{did_you_mean(unknown[0], valid)}")
        """The ``prompt_logprob_topk`` ... ``prompt_logprob_temperature`` row targets are the HTTP
        endpoint's (``teacher_server.server.protocol.SamplingParams`` documents them); their
        arrays come back in ``RequestOutput``."""
        check_n(ignored.get("n"), _SP + "n")
        self.targets = RowTargets(_whole(prompt_logprob_topk, "prompt_logprob_topk"),
                                  _flag(prompt_logprob_union, "prompt_logprob_union"),
                                  _flag(prompt_logprob_actual, "prompt_logprob_actual"),
                                  _flag(prompt_logprob_tail, "prompt_logprob_tail"),
                                  _flag(prompt_logprob_logsumexp, "prompt_logprob_logsumexp"),
                                  prompt_logprob_temperature)
        self.max_tokens = _whole(max_tokens, "max_tokens")
        # [K] or [rows, K] (-1 pads): lists or numpy integer arrays, or a base64 .npy string
        self.prompt_logprob_token_ids = prompt_logprob_token_ids
        self.prompt_logprob_start = _whole(prompt_logprob_start, "prompt_logprob_start")
        self.prompt_logprobs = _whole(prompt_logprobs, "prompt_logprobs")
        self.extra = ignored


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None = "length"
    text: str = ""
    logprobs: None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_token_id_logprobs: np.ndarray | None  # [rows, K] float32
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    num_cached_tokens: int = 0
    finished: bool = True
    # the row targets, when asked (one entry per scored row)
    prompt_topk_token_ids: np.ndarray | None = None  # [rows, K] int32
    prompt_topk_logprobs: np.ndarray | None = None  # [rows, K] float32
    prompt_union_token_ids: np.ndarray | None = None  # [rows, Kc + K] int32, -1 pads
    prompt_union_logprobs: np.ndarray | None = None  # [rows, Kc + K] float32
    prompt_actual_logprobs: np.ndarray | None = None  # [rows] float32
    prompt_tail_logprobs: np.ndarray | None = None  # [rows] float32
    prompt_logsumexp: np.ndarray | None = None  # [rows] float32


class LLM:
    """The scoring engine in this process. ``model`` is an HF checkpoint directory
    (None: the built-in demo model); keyword arguments are Config fields."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        cfg = kwargs.pop("config", None) or Config.load(overrides={"model": model, **kwargs}, env={})
        self.config = cfg
        self.engine = Engine(cfg)
        self.limits = Limits(self.engine.spec.vocab_size, self.engine.max_model_len, cfg.max_logprobs,
                             cfg.max_rows_x_k, processed=cfg.logprobs_mode == "processed_logprobs")
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor or pipeline parallel; none at size 1). Also
        done at the interpreter's exit; ``with LLM(...) as llm:`` closes at the block's end."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: TokensPrompt | Sequence[TokensPrompt] | Sequence[int],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, **vllm_kwargs: Any) -> list[RequestOutput]:
        """Score each prompt; one RequestOutput per prompt, in order. Invalid input raises
        ``teacher_server.validation.BadRequest`` (a ValueError) naming the field. vLLM's other
        keywords (``lora_request``, ``priority``, ...) are taken and change nothing; another raises
        TypeError, as vLLM's ``generate`` would."""
        unknown = sorted(set(vllm_kwargs) - _GENERATE_IGNORED)
        if unknown:
            raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}"
                            f"{did_you_mean(unknown[0], ['sampling_params', 'use_tqdm', *sorted(_GENERATE_IGNORED)])}")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], str)):
            raise TypeError("prompts must be token ids, not text: this service scores token ids only (it has no "
                            "tokenizer). Tokenize with the teacher's and student's shared tokenizer and pass "
                            "TokensPrompt(prompt_token_ids=tokenizer(text).input_ids)")
        if getattr(prompts, "ndim", None) == 1 and not isinstance(prompts, Sequence):  # one prompt's ids as an
            prompts = [prompts]  # array (numpy's, torch's)
        elif isinstance(prompts, dict) or (isinstance(prompts, Sequence) and prompts
                                           and isinstance(prompts[0], int | np.integer)):
            prompts = [prompts]
        prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
        if any("prompt_token_ids" not in p for p in prompts):  # vLLM's TextPrompt, {"prompt": "..."}
            raise TypeError("each prompt needs prompt_token_ids: this service scores token ids only (it has no "
                            "tokenizer); pass TokensPrompt(prompt_token_ids=[...])")
        for p in prompts:  # a misspelt cache_salt left out would share another tenant's cached prompts
            unknown = sorted(set(p) - set(_PROMPT_KEYS) - _PROMPT_IGNORED)
            if unknown:
                raise TypeError(f"a prompt has an unknown key {unknown[0]!r}"
                                f"{did_you_mean(unknown[0], [*_PROMPT_KEYS, *sorted(_PROMPT_IGNORED)])}")
            if p.get("cache_salt") is not None and not isinstance(p["cache_salt"], str):
                raise BadRequest(f"cache_salt must be a string, got {type(p['cache_salt']).__name__}", "cache_salt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        one = isinstance(sampling_params, SamplingParams) or not isinstance(sampling_params, list | tuple)
        sps = [sampling_params] * len(prompts) if one else list(sampling_params)
        if not all(isinstance(sp, SamplingParams) for sp in sps):  # (a dict, vLLM's own class: fields unread)
            bad = next(sp for sp in sps if not isinstance(sp, SamplingParams))
            raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got {type(bad).__name__}: "
                            "SamplingParams(**fields) from teacher_server.llm")
        if len(sps) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(sps)} sampling params")
        reqs = [build_request(token_ids=p["prompt_token_ids"], limits=self.limits,
                              candidates=_candidates(sp.prompt_logprob_token_ids), start=sp.prompt_logprob_start,
                              prompt_logprobs=sp.prompt_logprobs, max_tokens=sp.max_tokens,
                              request_id=str(next(self._ids)), cache_salt=p.get("cache_salt"),
                              targets=sp.targets, sampling_temperature=sp.extra.get("temperature"))
                for p, sp in zip(prompts, sps)]
        results = self.engine.run_to_completion(reqs)
        return [self._output(r, res) for r, res in zip(reqs, results)]

    def score(self, token_ids: Sequence[int] | np.ndarray, candidates: Any, start: int = 0) -> np.ndarray:
        """Convenience: the [rows, K] float32 matrix for one sequence. ``candidates`` is
        ``[K]`` or ``[rows, K]`` (lists or a numpy integer array, -1 pads), K >= 1."""
        ids = list(token_ids) if isinstance(token_ids, list | tuple) else np.asarray(token_ids).tolist()
        out = self.generate({"prompt_token_ids": ids},  # (a list as given: a True in it is refused, not id 1)
                            SamplingParams(max_tokens=0, prompt_logprob_token_ids=candidates,
                                           prompt_logprob_start=start))
        return out[0].prompt_token_id_logprobs

    @staticmethod
    def _output(req: Any, res: ScoreResult) -> RequestOutput:
        if res.error is not None:
            raise RuntimeError(f"request {req.request_id} failed: {res.error}")
        plp = None
        if req.prompt_logprobs is not None:
            plp = [None if e is None else {t: Logprob(v, r) for t, v, r in e}
                   for e in prompt_logprob_entries(req.token_ids, res)]
        nxt = [res.next_token] if req.max_tokens and res.next_token is not None else []
        out = RequestOutput(req.request_id, req.token_ids.tolist(), [CompletionOutput(0, nxt)],
                            res.token_id_logprobs, plp, res.cached_tokens,
                            prompt_topk_token_ids=res.topk_ids, prompt_topk_logprobs=res.topk_logprobs,
                            prompt_actual_logprobs=res.actual_logprobs, prompt_tail_logprobs=res.tail_logprobs,
                            prompt_logsumexp=res.logsumexp)
        if req.union:
            out.prompt_union_token_ids, out.prompt_union_logprobs = union_columns(
                req.candidates, res.token_id_logprobs, res.topk_ids, res.topk_logprobs)
        return out


def _candidates(value: Any) -> Any:
    """Candidates as an array, their form checked in the client's words (``candidates: ...``,
    the same rule and message the client gives before sending); ``build_request`` adds the
    bounds. base64 ``.npy`` strings and None pass through to it."""
    if value is None or isinstance(value, str):
        return value
    try:
        return candidate_ids(value)
    except InvalidIds as e:
        raise BadRequest(str(e), _CANDIDATES) from None
