"""config.json keys that transformers reads in a way of its own, served as transformers serves
them: each tiny checkpoint's scores against the float32 forward of transformers reloaded from
the same files (so the reference reads the edited config.json as a user's would)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek_ref import COMMON as DEEPSEEK_COMMON
from deepseek_ref import CONFIGS as DEEPSEEK_CONFIGS
from gemma_glm_ref import GEMMA_COMMON, F, S
from reference import ROUTER, randomize_weights

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

TOL = 1e-4  # float32 engine vs float32 transformers, as test_parity
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def save(path: Path, model_cls, cfg, edit: Callable[[dict], None]) -> Path:
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32).eval()
    randomize_weights(model, (ROUTER,))
    model.save_pretrained(path, safe_serialization=True)
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    return path


def worst_error(path: Path, n: int = 48) -> float:
    """Max |engine - transformers| over every vocab id at every position of one n-token sequence
    (chunked: a 16-token step budget)."""
    import transformers as tf

    ref_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    vocab = ref_model.config.get_text_config().vocab_size
    toks = np.random.default_rng(1).integers(0, vocab, n).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([toks])).logits[0, :-1].double(), -1).numpy()
    eng = Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=16, block_size=8, num_kv_blocks=64,
                        max_model_len=256, max_logprobs=-1))
    (res,) = eng.run_to_completion([ScoreRequest("x", np.asarray(toks), 0, np.arange(vocab), max_tokens=1)])
    assert res.error is None, res.error
    return float(np.abs(res.token_id_logprobs - ref).max())


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32, "rope_theta": 10000.0},
])
def test_a_top_level_pretraining_length_wins_over_the_rope_dicts(tmp_path, rope: dict) -> None:
    """transformers takes a top-level original_max_position_embeddings over the rope dict's for
    llama3 and YaRN (error 0.76-1.07 when the dict's was used)."""
    import transformers as tf

    def edit(d: dict) -> None:
        d["rope_parameters"] = dict(rope)
        d["original_max_position_embeddings"] = 8
    path = save(tmp_path, tf.LlamaForCausalLM, tf.LlamaConfig(**LLAMA), edit)
    assert worst_error(path) < TOL


def test_yarn_with_a_null_factor_takes_the_ratio_of_the_lengths(tmp_path) -> None:
    """``"factor": null``: max_position_embeddings / original_max_position_embeddings, as
    transformers derives it (it had failed after the weights loaded)."""
    import transformers as tf

    def edit(d: dict) -> None:
        d["rope_parameters"] = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16,
                                "rope_theta": 10000.0}
    path = save(tmp_path, tf.LlamaForCausalLM, tf.LlamaConfig(**LLAMA), edit)
    assert worst_error(path) < TOL


@pytest.mark.parametrize("bad", [{"rope_type": "linear", "factor": None}, {"rope_type": "linear", "factor": "4"},
                                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}])
def test_rope_numbers_that_cannot_be_read_are_refused_at_the_config(bad: dict) -> None:
    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    d = {**LLAMA, "architectures": ["LlamaForCausalLM"], "rope_parameters": bad}
    with pytest.raises(UnsupportedModelError, match=r"factor.* a number|original_max_position_embeddings=0"):
        ModelSpec.from_dict(d)


@pytest.mark.parametrize("vl", [False, True])
def test_gemma3_legacy_rope_scaling_beside_per_kind_rope_parameters(tmp_path, vl: bool) -> None:
    """transformers merges a legacy rope_scaling into the global layers' rope; it had been
    dropped (the global layers unscaled: error 2.8-3.3)."""
    import transformers as tf

    text = tf.Gemma3TextConfig(**{**GEMMA_COMMON, "vocab_size": 128, "sliding_window": 6, "num_hidden_layers": 2,
                                  "layer_types": [S, F]})

    def edit(d: dict) -> None:
        (d["text_config"] if vl else d)["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    if vl:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
        path = save(tmp_path, tf.Gemma3ForConditionalGeneration, cfg, edit)
    else:
        path = save(tmp_path, tf.Gemma3ForCausalLM, text, edit)
    assert tf.AutoConfig.from_pretrained(path).get_text_config().rope_parameters[F]["factor"] == 4.0
    assert worst_error(path) < TOL


def test_gemma3_vision_language_head_untied_where_the_top_level_is_silent(tmp_path) -> None:
    """The head saved as ``language_model.lm_head.weight`` with no top-level tie_word_embeddings:
    transformers scores with it; the engine had looked for ``lm_head.weight``, found none and
    tied the head to the embedding (error 39.5)."""
    import transformers as tf

    text = tf.Gemma3TextConfig(**{**GEMMA_COMMON, "vocab_size": 128, "sliding_window": 6, "num_hidden_layers": 2,
                                  "layer_types": [S, F], "tie_word_embeddings": False})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          tie_word_embeddings=False)
    path = save(tmp_path, tf.Gemma3ForConditionalGeneration, cfg, lambda d: d.pop("tie_word_embeddings", None))
    assert worst_error(path) < TOL


def test_deepseek_v2_top_k_weights_are_scaled_not_renormalised(tmp_path) -> None:
    """A V2 config with norm_topk_prob true: transformers' V2 router scales the top-k weights by
    routed_scaling_factor and never renormalises them (error 0.42 when both were done)."""
    import transformers as tf

    keys = {**DEEPSEEK_COMMON, **DEEPSEEK_CONFIGS["v2"][1], "routed_scaling_factor": 2.5, "vocab_size": 128}
    path = save(tmp_path, tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(**keys),
                lambda d: d.update(norm_topk_prob=True))
    assert worst_error(path) < TOL
