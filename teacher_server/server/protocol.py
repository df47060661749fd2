"""Pydantic models of the HTTP API (they also make the OpenAPI page)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, FailFast, Field, StrictBool, StrictInt, StrictStr


class _FailFast(FailFast):
    """pydantic's FailFast, hashable (a union of annotated types hashes its members)."""

    def __hash__(self) -> int:
        return hash(FailFast)


# Lists and maps stop at their first bad element: a body of millions of wrong values is one
# error, not millions (each a dict pydantic builds and the front then searches).
_FF = _FailFast()
IntList = Annotated[list[StrictInt], _FF]


class SamplingParams(BaseModel):
    """vLLM sampling parameters. Only the scoring fields change the result; the others are
    accepted and ignored (vLLM's prompt scores ignore them too); unknown fields are 400."""

    model_config = ConfigDict(extra="forbid")

    prompt_logprob_token_ids: IntList | Annotated[list[IntList], _FF] | StrictStr | None = Field(
        None, description="Candidates: a flat list of K ids shared by every scored row, a list of `rows` "
                          "lists of K ids (-1 pads), or a base64 `.npy` int32/int64 array of shape [K] or [rows, K].")
    prompt_logprob_start: StrictInt | None = Field(
        None, description="First scored causal row (default 0); typically len(prompt) - 1.")
    prompt_logprobs: StrictInt | None = Field(
        None, description="Classic per-position top-k (teacher's top-k plus the actual token).")
    max_tokens: StrictInt | None = Field(
        1, description="0 or 1; 1 also returns the greedy next token. This server does not generate.")
    truncate_prompt_tokens: StrictInt | None = Field(None, description="Not supported: inputs are never truncated.")
    # Accepted for compatibility; they do not change the scores.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], _FF] | None = None
    stop_token_ids: Annotated[list[int], _FF] | None = None
    bad_words: Annotated[list[str], _FF] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: Annotated[dict[str, float], _FF] | None = None
    allowed_token_ids: Annotated[list[int], _FF] | None = None
    extra_args: dict[str, Any] | None = None
    output_kind: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    n: int | None = None
    best_of: int | None = None
    flat_logprobs: bool | None = None
    logits_processors: Any = None
    skip_reading_prefix_cache: bool | None = None
    skip_clone: bool | None = None


class GenerateRequest(BaseModel):
    """Body of `POST /inference/v1/generate` (vLLM's tokens-in endpoint)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: IntList = Field(..., description="Prompt ids followed by response ids (at least one).")
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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
