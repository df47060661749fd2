"""The in-process API refuses what it would otherwise score wrongly: a misspelt SamplingParams
field (it used to be ignored, scoring every row from 0) and text prompts (the service takes
token ids only), a value of the wrong type (1.5 for a row index), a misspelt prompt key (a
cache salt dropped); no engine is needed to refuse them. A numpy prompt scores as its list."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt_logprob_start": 1.5}, "prompt_logprob_start"), ({"prompt_logprob_start": "4"}, "prompt_logprob_start"),
    ({"prompt_logprobs": 2.5}, "prompt_logprobs"), ({"max_tokens": True}, "max_tokens"),
    ({"prompt_logprob_topk": 2.0}, "prompt_logprob_topk"), ({"prompt_logprob_union": "yes"}, "prompt_logprob_union"),
    ({"n": 2}, "n"), ({"n": True}, "n")])
def test_a_value_the_http_endpoint_refuses_is_refused_here_naming_it(kwargs: dict, field: str) -> None:
    """As POST /inference/v1/generate answers them (a 400): never int(1.5) scoring other rows."""
    from teacher_server.validation import BadRequest

    with pytest.raises(BadRequest, match=field) as e:
        SamplingParams(prompt_logprob_token_ids=[1], **kwargs)
    assert e.value.param == f"sampling_params.{field}"


def test_numpy_integers_are_ids() -> None:
    sp = SamplingParams(prompt_logprob_start=np.int64(3), prompt_logprobs=np.int32(2), n=1.0)
    assert (sp.prompt_logprob_start, sp.prompt_logprobs) == (3, 2) and type(sp.prompt_logprob_start) is int


def test_a_misspelt_prompt_key_is_refused_not_dropped() -> None:
    """{"cache_slat": ...} dropped would score the prompt unsalted, sharing another tenant's cache."""
    llm = LLM.__new__(LLM)  # the refusal comes before the engine is touched
    with pytest.raises(TypeError, match=r"'cache_slat'.*did you mean 'cache_salt'"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_slat": "tenant-b"}, SamplingParams(prompt_logprob_token_ids=[1]))
    from teacher_server.validation import BadRequest

    with pytest.raises(BadRequest, match="cache_salt must be a string"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": 5}, SamplingParams(prompt_logprob_token_ids=[1]))


def test_a_numpy_prompt_scores_as_its_list() -> None:
    llm = LLM(max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    try:
        ids = np.arange(1, 12, dtype=np.int64)
        sp = SamplingParams(max_tokens=0, prompt_logprob_token_ids=[1, 2], prompt_logprob_start=4)
        want = llm.generate({"prompt_token_ids": ids.tolist()}, sp)[0].prompt_token_id_logprobs
        for prompt in (ids, list(ids), {"prompt_token_ids": ids}):  # an array, numpy ints, an array in a dict
            np.testing.assert_array_equal(llm.generate(prompt, sp)[0].prompt_token_id_logprobs, want)
    finally:
        llm.engine.close()


def test_a_bool_among_ids_is_refused_as_http_refuses_it() -> None:
    """[True, 2, 3] had scored as [1, 2, 3] in the LLM and been sent as it by the client (numpy
    makes 1 of True beside ints); the HTTP endpoint answers 400. So are a bool temperature, a
    dict for sampling_params (its fields were never read: an AttributeError) and a keyword vLLM's
    generate does not take (it was dropped)."""
    from teacher_server.client import Targets, TeacherRequest
    from teacher_server.client.protocol import build_body
    from teacher_server.validation import BadRequest

    llm = LLM(max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    try:
        sp = SamplingParams(prompt_logprob_token_ids=[1])
        for prompt in ([True, 2, 3], {"prompt_token_ids": (1, np.False_, 3)}):
            with pytest.raises(BadRequest, match="token_ids must hold integer ids, not True/False"):
                llm.generate(prompt, sp)
        with pytest.raises(BadRequest, match="token_ids must hold integer ids, not True/False"):
            llm.score([True, 2, 3], [7])
        with pytest.raises(BadRequest, match="candidates must hold integer ids, not True/False") as e:
            llm.generate([1, 2, 3], SamplingParams(prompt_logprob_token_ids=[True, 5]))
        assert e.value.param == "sampling_params.prompt_logprob_token_ids"
        with pytest.raises(BadRequest, match="prompt_logprob_temperature"):
            llm.generate([1, 2, 3], SamplingParams(prompt_logprob_token_ids=[1], prompt_logprob_temperature=True))
        with pytest.raises(TypeError, match="sampling_params must be SamplingParams .* got dict"):
            llm.generate([1, 2, 3], {"max_tokens": 0})
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            llm.generate([1, 2, 3], sp, bogus=2)
    finally:
        llm.engine.close()
    with pytest.raises(TypeError, match="token_ids must hold integer ids, not True/False"):
        build_body(TeacherRequest([True, 2, 3], [1]))
    with pytest.raises(TypeError, match="not True/False"):
        build_body(TeacherRequest([1, 2, 3], [[True, 5]]))
    with pytest.raises(TypeError, match="targets.temperature must be a number, got bool"):
        build_body(TeacherRequest([1, 2, 3], [1], targets=Targets(temperature=True)))
    assert build_body(TeacherRequest((1, 2, 3), [1], targets=Targets(temperature=np.float32(2))))["token_ids"] == [1, 2, 3]


def test_a_torch_prompt_scores_as_its_list() -> None:
    torch = pytest.importorskip("torch")
    llm = LLM(max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=64, block_size=8)
    try:
        sp = SamplingParams(max_tokens=0, prompt_logprob_token_ids=[1, 2], prompt_logprob_start=4)
        want = llm.generate(list(range(1, 12)), sp)[0].prompt_token_id_logprobs
        got = llm.generate(torch.arange(1, 12), sp, lora_request=None)[0].prompt_token_id_logprobs
        np.testing.assert_array_equal(got, want)
    finally:
        llm.engine.close()
