"""Pydantic models of the HTTP API (they also make the OpenAPI page)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, FailFast, Field, StrictBool, StrictFloat, StrictInt, StrictStr


class _FailFast(FailFast):
    """pydantic's FailFast, hashable (a union of annotated types hashes its members)."""

    def __hash__(self) -> int:
        return hash(FailFast)


# Lists and maps stop at their first bad element: a body of millions of wrong values is one
# error, not millions (each a dict pydantic builds and the front then searches).
_FF = _FailFast()
IntList = Annotated[list[StrictInt], _FF]


class IgnoredSampling(BaseModel):
    """vLLM's sampling fields that do not change the scores, on the native endpoint's
    ``sampling_params`` and /v1/completions alike: read as vLLM's request models read them
    (pydantic's lax types: "0.9" is 0.9), so a value of the wrong type is a 400 here too."""

    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], _FF] | None = None
    stop_token_ids: Annotated[list[int], _FF] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: Annotated[dict[str, float], _FF] | None = None
    allowed_token_ids: Annotated[list[int], _FF] | None = None


class SamplingParams(IgnoredSampling):
    """vLLM sampling parameters. Only the scoring fields change the result; the others are
    accepted and ignored (vLLM's prompt scores ignore them too); unknown fields are 400."""

    model_config = ConfigDict(extra="forbid")

    prompt_logprob_token_ids: IntList | Annotated[list[IntList], _FF] | StrictStr | None = Field(
        None, description="Candidates: a flat list of K ids shared by every scored row, a list of `rows` "
                          "lists of K ids (-1 pads), or a base64 `.npy` int32/int64 array of shape [K] or [rows, K].")
    prompt_logprob_start: StrictInt | None = Field(
        None, description="First scored causal row (default 0); typically len(prompt) - 1.")
    prompt_logprobs: StrictInt | None = Field(
        None, description="Classic per-position top-k (teacher's top-k plus the actual token); -1: the whole "
                          "vocabulary (within max_logprobs).")
    max_tokens: StrictInt | None = Field(
        1, description="0 or 1; 1 also returns the greedy next token. This server does not generate.")
    # The row targets: more of the scored rows (those of prompt_logprob_start, one per scored
    # token), all from the same prefill; returned as base64 `.npy` arrays.
    prompt_logprob_topk: StrictInt | None = Field(
        None, description="The teacher's own top-K per scored row: `prompt_topk_token_ids` ([rows, K] int32) and "
                          "`prompt_topk_logprobs` ([rows, K] float32), by rank. Needs no candidates.")
    prompt_logprob_union: StrictBool | None = Field(
        None, description="With candidates and `prompt_logprob_topk`: `prompt_union_token_ids` / "
                          "`prompt_union_logprobs` ([rows, Kc + K]): the candidates' columns, then the top-K ids "
                          "not among that row's candidates by rank, then -1 padding (-inf).")
    prompt_logprob_actual: StrictBool | None = Field(
        None, description="`prompt_actual_logprobs` ([rows] float32): the log-prob of each scored (actual next) token.")
    prompt_logprob_tail: StrictBool | None = Field(
        None, description="`prompt_tail_logprobs` ([rows] float32): log of the probability mass outside the returned "
                          "columns (the row's candidates and its top-K ids, each id once); -inf when nothing is left. "
                          "With raw_logits: log-sum-exp of the other logits.")
    prompt_logprob_logsumexp: StrictBool | None = Field(
        None, description="`prompt_logsumexp` ([rows] float32): the log normalizer of each row's (temperature-scaled) "
                          "logits; log-prob = logit / T - logsumexp.")
    prompt_logprob_temperature: StrictFloat | None = Field(
        None, description="Divide the logits by this (> 0) before the softmax, for every score of the request "
                          "(candidates, top-K, prompt_logprobs, actual, tail, logsumexp): vLLM's "
                          "`--logprobs-mode processed_logprobs` semantics (logits / T, then log_softmax). Default 1. "
                          "`temperature` changes scores only with `--logprobs-mode processed_logprobs` (this "
                          "field wins over it).")
    truncate_prompt_tokens: StrictInt | None = Field(None, description="Not supported: inputs are never truncated.")
    # Accepted for compatibility; they do not change the scores (``temperature`` does with
    # ``--logprobs-mode processed_logprobs``: a number, or a string of one as vLLM reads it).
    temperature: StrictFloat | StrictStr | None = None
    bad_words: Annotated[list[str], _FF] | None = None
    logprobs: int | None = None
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    extra_args: dict[str, Any] | None = None
    output_kind: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    n: StrictInt | StrictFloat | None = Field(
        None, description="1 only (1.0 too, as vLLM reads it): this server does not sample (400 otherwise).")
    best_of: int | None = None
    flat_logprobs: bool | None = None
    logits_processors: Any = None
    skip_reading_prefix_cache: bool | None = None
    skip_clone: bool | None = None


class GenerateRequest(BaseModel):
    """Body of `POST /inference/v1/generate` (vLLM's tokens-in endpoint)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: IntList = Field(..., description="Prompt ids followed by response ids (at least one).",
                               json_schema_extra={"minItems": 1})
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    request_id: StrictStr | None = Field(None, description="Echoed back; generated when absent.")
    model: StrictStr | None = Field(None, description="Must name the served model.")
    stream: StrictBool = False
    cache_salt: StrictStr | None = Field(None, description="Isolates prefix-cache entries between tenants.")
    priority: StrictInt = Field(0, description="Lower values are scheduled earlier; at most priority_limit (1000 by "
                                               "default) either way, 400 beyond.")
    return_token_ids: StrictBool | None = Field(None, description="Echo `prompt_token_ids`.")
    # Fields of vLLM's generate request that do not apply to scoring: accepted and ignored, so
    # requests built for vLLM work unchanged. Fields no vLLM request has are still rejected.
    features: Any = Field(None, description="vLLM multimodal features: accepted and ignored.")
    stream_options: Any = Field(None, description="vLLM streaming options: accepted and ignored (no streaming).")
    kv_transfer_params: Any = Field(None, description="vLLM disaggregated-serving parameters: accepted and ignored.")
    assistant_tokens_mask: Any = Field(None, description="vLLM render metadata: accepted and ignored.")
    token_offsets: Any = Field(None, description="vLLM render metadata: accepted and ignored.")


class Choice(BaseModel):
    index: int = 0
    token_ids: list[int]
    finish_reason: str | None
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    created: int
    choices: list[Choice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(
        None, description="Classic per-position logprobs: first entry null; actual token first, then top-k.")
    prompt_token_id_logprobs: str | None = Field(
        None, description="base64 of np.save bytes of the [rows, K] float32 matrix.")
    prompt_token_ids: list[int] | None = None
    prompt_topk_token_ids: str | None = Field(
        None, description="When `prompt_logprob_topk` = K: base64 `.npy` [rows, K] int32, the teacher's top-K ids.")
    prompt_topk_logprobs: str | None = Field(None, description="base64 `.npy` [rows, K] float32, their log-probs.")
    prompt_union_token_ids: str | None = Field(
        None, description="When `prompt_logprob_union`: base64 `.npy` [rows, Kc + K] int32 (-1 pads).")
    prompt_union_logprobs: str | None = Field(
        None, description="base64 `.npy` [rows, Kc + K] float32 (-inf at padding).")
    prompt_actual_logprobs: str | None = Field(
        None, description="When `prompt_logprob_actual`: base64 `.npy` [rows] float32.")
    prompt_tail_logprobs: str | None = Field(
        None, description="When `prompt_logprob_tail`: base64 `.npy` [rows] float32, log of the mass outside.")
    prompt_logsumexp: str | None = Field(
        None, description="When `prompt_logprob_logsumexp`: base64 `.npy` [rows] float32.")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
