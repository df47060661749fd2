"""The in-process API refuses what it would otherwise score wrongly: a misspelt SamplingParams
field (it used to be ignored, scoring every row from 0) and text prompts (the service takes
token ids only). No engine is needed to refuse them."""

from __future__ import annotations

import pytest

from teacher_server import LLM, SamplingParams
from teacher_server.llm import VLLM_IGNORED_FIELDS


def test_a_misspelt_field_names_itself_and_the_closest_name() -> None:
    with pytest.raises(TypeError, match=r"'prompt_logprob_strat'.*did you mean 'prompt_logprob_start'"):
        SamplingParams(prompt_logprob_strat=4)
    with pytest.raises(TypeError, match=r"'prompt_logprob_token_id'.*'prompt_logprob_token_ids'"):
        SamplingParams(prompt_logprob_token_id=[1, 2])
    with pytest.raises(TypeError, match=r"'zzz'$"):  # nothing close: no guess
        SamplingParams(zzz=1)


def test_vllm_fields_are_still_accepted() -> None:
    sp = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=3, skip_special_tokens=True)
    assert sp.extra == {"temperature": 0.7, "top_p": 0.9, "seed": 3, "skip_special_tokens": True}


def test_ignored_fields_match_the_http_endpoint() -> None:
    from teacher_server.llm import _SCORING_FIELDS
    from teacher_server.server.protocol import SamplingParams as HttpSamplingParams

    assert set(HttpSamplingParams.model_fields) - set(_SCORING_FIELDS) == VLLM_IGNORED_FIELDS


@pytest.mark.parametrize("prompt", ["hello world", ["hello", "world"], {"prompt": "hello world"}])
def test_text_prompts_say_the_service_takes_token_ids(prompt) -> None:
    llm = LLM.__new__(LLM)  # the refusal comes before the engine is touched
    with pytest.raises(TypeError, match="token ids only.*prompt_token_ids"):
        llm.generate(prompt, SamplingParams(prompt_logprob_token_ids=[1]))
