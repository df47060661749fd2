"""Checkpoint loading: single file, sharded with an index, sharded without one, dummy."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from reference import reference_scores

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.models.loader import checkpoint_files


def score(path, **kw):
    eng = Engine(Config(model=str(path), device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256, **kw))
    toks = np.arange(3, 60)
    return eng.run_to_completion([ScoreRequest("x", toks, 10, np.array([1, 2, 3]))])[0].token_id_logprobs, toks


@pytest.mark.parametrize("keep_index", [True, False])
def test_sharded(tmp_path, keep_index) -> None:
    import transformers as tf

    cfg = tf.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(checkpoint_files(tmp_path)) > 1
    ref = reference_scores(tmp_path, list(range(3, 60)), np.array([1, 2, 3]), 10)
    if not keep_index:
        (tmp_path / "model.safetensors.index.json").unlink()
    got, toks = score(tmp_path)
    assert np.abs(got - ref).max() < 1e-4


def test_missing_weight_is_refused(tmp_path, checkpoints) -> None:
    from safetensors.torch import load_file, save_file

    src = checkpoints["llama"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    w = load_file(tmp_path / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        score(tmp_path)


def test_a_part_given_twice_does_not_stand_in_for_one_missing(tmp_path, checkpoints) -> None:
    """q_proj in two files and k_proj in none: the fused q/k/v had its three writes, and loaded
    with k's rows never written (every score NaN). Both are named."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["llama"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    w = load_file(tmp_path / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    del w["model.layers.0.self_attn.k_proj.weight"]
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    save_file({q: w[q]}, tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"more than once .*{q} \+ .*{q}.*; and is missing weights for: "
                                         rf"layers\.0\.self_attn\.qkv_proj\.weight \(given only {q}, "):
        score(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.0001])  # data cut off; the header itself cut
def test_a_truncated_file_is_named(tmp_path, checkpoints, keep: float) -> None:
    src = checkpoints["llama"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: max(int(f.stat().st_size * keep), 8)])
    with pytest.raises(ValueError, match=re.escape(str(f)) + r".*truncated or corrupt.*fetch it again"):
        score(tmp_path)


@pytest.mark.parametrize(("index", "error"), [
    ("{'weight_map': {}}", "is not a safetensors index: Expecting property name"),
    ('{"metadata": {}}', "has no weight_map"),
    ('{"weight_map": ["model.safetensors"]}', "is not a safetensors index"),
    ('{"weight_map": {"lm_head.weight": 3}}', "weight_map's values must be file names"),
    ('{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}',
     "model-00002-of-00002.safetensors is missing \\(the folder's model.safetensors.index.json names it\\)"),
])
def test_a_broken_index_or_shard_is_named(tmp_path, checkpoints, index: str, error: str) -> None:
    for f in checkpoints["llama"].iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*" + error):
        score(tmp_path)


def test_a_dangling_cache_link_is_named(tmp_path, checkpoints) -> None:
    """A cache snapshot whose blob is gone (no index: the message names the link, not an index)."""
    src = checkpoints["llama"]
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123abcd")
    with pytest.raises(ValueError, match=r"model\.safetensors is a link to .*blobs/0123abcd, which is missing"):
        score(tmp_path)


def test_an_unreadable_shard_is_not_called_corrupt(tmp_path, checkpoints) -> None:
    for f in checkpoints["llama"].iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-2.safetensors"}}')
    (tmp_path / "model-2.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model-2\.safetensors cannot be read by this process .*not a regular file"):
        score(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_infinite_weights_are_refused_by_name(tmp_path, checkpoints, value: float) -> None:
    """One bad number would make every score NaN (and the drop-in endpoints' -9999.0)."""
    from safetensors.torch import load_file, save_file

    for f in checkpoints["llama"].iterdir():
        shutil.copy(f, tmp_path / f.name)
    w = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    w[name] = w[name].clone()
    w[name][3, 5] = value
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"holds NaN or infinite values in: {re.escape(name)} \(every score"):
        score(tmp_path)


def test_nonfinite_reads_each_float_kind_in_row_chunks() -> None:
    import torch

    from teacher_server.models.loader import nonfinite

    def bad(x: torch.Tensor, **kw: int) -> bool:
        flags = nonfinite(x, **kw)
        return bool(torch.stack(flags).any()) if flags else False

    x = torch.randn(10, 8)[:, ::2]  # not contiguous: read as it is, no copy
    assert not bad(x) and len(nonfinite(x, chunk=8)) == 5
    x[9, 3] = float("-inf")
    assert bad(x, chunk=8)
    assert bad(torch.tensor(float("nan"))) and nonfinite(torch.zeros(3, dtype=torch.uint8)) == []
    assert nonfinite(torch.zeros(0, 5)) == [] == nonfinite(torch.zeros(0, 5, dtype=torch.float8_e4m3fn))
    for dtype, nan in [(torch.float8_e4m3fn, 0x7F), (torch.float8_e5m2, 0xFC), (torch.float8_e4m3fnuz, 0x80),
                       (torch.float8_e8m0fnu, 0xFF)]:  # (e8m0: MXFP4's scales; isfinite calls its NaN finite)
        codes = torch.full((4, 4), 0x3C, dtype=torch.uint8)
        assert not bad(codes.view(dtype)), dtype
        codes[2, 1] = nan
        assert bad(codes.view(dtype)), dtype


def test_shape_mismatch_is_refused(tmp_path, checkpoints) -> None:
    src = checkpoints["llama"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        score(tmp_path)


def test_dummy_load_format(tmp_path, checkpoints) -> None:
    (tmp_path / "config.json").write_text((checkpoints["qwen3"] / "config.json").read_text())
    got, _ = score(tmp_path, load_format="dummy")  # no safetensors needed
    assert got.shape == (46, 3) and np.isfinite(got).all() and (got < 0).all()


def test_loading_logs_progress_per_file(tmp_path, caplog) -> None:
    """One INFO line per safetensors file: its number of all, its size and the seconds taken."""
    import logging

    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="100KB")
    n = len(checkpoint_files(tmp_path))
    assert n > 1
    with caplog.at_level(logging.INFO, logger="teacher_server.models.loader"):
        score(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "teacher_server.models.loader"]
    per_file = [m for m in lines if m.startswith("loaded checkpoint file ")]
    assert [m.split()[3] for m in per_file] == [f"{i}/{n}" for i in range(1, n + 1)], lines
    assert all(" GB) in " in m and m.endswith("s") for m in per_file), per_file


def test_registry_maps_each_architecture_to_its_family_class() -> None:
    from teacher_server.models.llama import LlamaForCausalLM
    from teacher_server.models.qwen3 import Qwen3ForCausalLM
    from teacher_server.models.registry import ARCHITECTURES, model_class

    assert model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert model_class(arch) is LlamaForCausalLM
    from teacher_server.models.mixtral import MixtralForCausalLM
    from teacher_server.models.qwen2_moe import Qwen2MoeForCausalLM
    from teacher_server.models.qwen3_moe import Qwen3MoeForCausalLM

    assert model_class("Qwen3MoeForCausalLM") is Qwen3MoeForCausalLM
    assert model_class("Qwen2MoeForCausalLM") is Qwen2MoeForCausalLM
    assert model_class("MixtralForCausalLM") is MixtralForCausalLM
    from teacher_server.models.qwen3_5 import Qwen3_5ForCausalLM
    from teacher_server.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"):
        assert model_class(arch) is Qwen3_5ForCausalLM
    for arch in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        assert model_class(arch) is Qwen3_5MoeForCausalLM
    from teacher_server.models.deepseek import DeepseekForCausalLM

    for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        assert model_class(arch) is DeepseekForCausalLM
    from teacher_server.models.gpt_oss import GptOssForCausalLM
    from teacher_server.models.qwen3_next import Qwen3NextForCausalLM

    assert model_class("GptOssForCausalLM") is GptOssForCausalLM
    assert model_class("Qwen3NextForCausalLM") is Qwen3NextForCausalLM
    from teacher_server.models.gemma3 import Gemma3ForCausalLM
    from teacher_server.models.glm4_moe import Glm4MoeForCausalLM

    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        assert model_class(arch) is Gemma3ForCausalLM
    assert model_class("Glm4MoeForCausalLM") is Glm4MoeForCausalLM
    assert {a.family for a in ARCHITECTURES.values()} == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                                          "qwen2_moe", "mixtral", "qwen3_5", "qwen3_5_moe",
                                                          "deepseek_v3", "deepseek_v2", "gemma3", "glm4_moe",
                                                          "gpt_oss", "qwen3_next"}


@pytest.mark.parametrize(("change", "says"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized checkpoints"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor, high_freq_factor"),
])
def test_what_changes_the_math_and_is_not_built_is_refused_by_name(change: dict, says: str) -> None:
    """A config the engine would score differently from transformers (another activation) or
    fail on with a misleading message (biases it has no place for, quantized weights) is
    refused at once, naming what is not supported."""
    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "silu", "max_position_embeddings": 256}
    ModelSpec.from_dict(base)
    with pytest.raises(UnsupportedModelError, match=re.escape(says)):
        ModelSpec.from_dict({**base, **change})
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True}
    assert ModelSpec.from_dict(qwen2).attention_bias  # Qwen2's q/k/v biases are built
    llama3 = ModelSpec.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0}})
    assert llama3.rope_scaling["original_max_position_embeddings"] == 256  # as transformers defaults it


def test_the_config_decides_whether_the_head_is_tied(tmp_path) -> None:
    """``tie_word_embeddings: false`` without ``lm_head.weight`` is a missing weight, not a
    silently tied head; a stray export beside ``model.safetensors`` is not read."""
    from reference import make_checkpoint
    from safetensors.torch import save_file

    ckpt = make_checkpoint("llama", tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (ckpt / "config.json").write_text(json.dumps(cfg))
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as sf:
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    assert "lm_head.weight" in tensors
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(ckpt / "consolidated.safetensors"))
    Engine(Config(model=str(ckpt), device="cpu"))  # the stray export is not read
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(Exception, match=r"missing weights for: lm_head\.weight \(config\.json's tie_word_embeddings is "
                                         r"false"):
        Engine(Config(model=str(ckpt), device="cpu"))


def tiny_configs() -> dict:
    """A tiny config of each supported text architecture, from its transformers config class."""
    import transformers as tf

    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    made = {
        "LlamaForCausalLM": ("LlamaConfig", dict(intermediate_size=96)),
        "MistralForCausalLM": ("MistralConfig", dict(intermediate_size=96, sliding_window=64)),
        "Qwen2ForCausalLM": ("Qwen2Config", dict(intermediate_size=96)),
        "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=16, intermediate_size=96)),
        "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(head_dim=16, intermediate_size=96, num_experts=8, **moe)),
        "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(intermediate_size=96, num_experts=8,
                                                       shared_expert_intermediate_size=48, **moe)),
        "MixtralForCausalLM": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
        "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(head_dim=16, intermediate_size=96)),
        "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(head_dim=16, num_experts=8,
                                                               shared_expert_intermediate_size=48, **moe)),
    }
    return {arch: getattr(tf, cls)(**base, **kw) for arch, (cls, kw) in made.items() if hasattr(tf, cls)}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                                  "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_a_key_config_json_leaves_out_means_what_it_means_to_transformers(arch: str, tmp_path) -> None:
    """Each key of a saved config.json left out in turn: the spec of what is left equals the
    spec of the config transformers makes of it (its class default in the key's place: Mistral's
    4096-token window, Mixtral's rope_theta 1e6 and rms_norm_eps 1e-5, Qwen3's head_dim 128...).
    Not ``tie_word_embeddings``: without it the checkpoint decides (a head from lm_head.weight
    when there is one, else the tied embedding; transformers would make a random head)."""
    from dataclasses import asdict

    import transformers as tf

    from teacher_server.models.spec import ModelSpec

    cfg = tiny_configs().get(arch)
    if cfg is None:
        pytest.skip(f"this transformers has no config class for {arch}")
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    full = json.loads((tmp_path / "config.json").read_text())
    compared = 0
    for key in sorted(set(full) - {"architectures", "model_type", "transformers_version", "tie_word_embeddings"}):
        left = {k: v for k, v in full.items() if k != key}
        (tmp_path / "config.json").write_text(json.dumps(left))
        try:
            theirs = tf.AutoConfig.from_pretrained(tmp_path).to_dict()
        except Exception:
            continue
        theirs["architectures"] = [arch]
        assert asdict(ModelSpec.from_dict(left)) == asdict(ModelSpec.from_dict(theirs)), key
        compared += 1
    assert compared >= 10


def test_rope_theta_in_rope_parameters_wins_over_the_top_level_one(tmp_path) -> None:
    """A config.json with rope_theta in rope_parameters and (another) at the top level: transformers
    takes rope_parameters', and so does the spec."""
    import transformers as tf

    from teacher_server.models.spec import ModelSpec

    cfg = tiny_configs()["Qwen3ForCausalLM"]
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    d["rope_theta"] = 5.0
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert tf.AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"] == 1e6
    assert ModelSpec.from_dict(d).rope_theta == 1e6
    assert ModelSpec.from_dict({k: v for k, v in d.items() if k != "rope_parameters"}).rope_theta == 5.0


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 4.0},
                                     {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                                     {"rope_type": "linear", "factor": 2.0, "rope_theta": 300.0}])
def test_rope_scaling_given_beside_rope_parameters_is_read_whole_as_transformers_does(tmp_path, scaling) -> None:
    """A legacy rope_scaling (``type``) added to a config that transformers 5 saved with a default
    rope_parameters: transformers takes rope_scaling whole; the spec had let the default rope win."""
    import transformers as tf

    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    cfg = tiny_configs()["Qwen3ForCausalLM"]
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    d["rope_scaling"] = scaling
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs = tf.AutoConfig.from_pretrained(tmp_path).rope_parameters
    spec = ModelSpec.from_dict(d)
    assert spec.rope_scaling["rope_type"] == theirs["rope_type"] != "default"
    assert spec.rope_scaling["factor"] == theirs["factor"] and spec.rope_theta == theirs["rope_theta"]
    for bad, said in (({"type": "dynamic", "factor": 2.0}, "unsupported rope scaling 'dynamic'"),
                      ({"type": scaling.get("type", "linear")}, "rope scaling without factor")):
        with pytest.raises(UnsupportedModelError, match=said):
            ModelSpec.from_dict({**d, "rope_scaling": bad})


@pytest.mark.parametrize(("edit", "said"), [
    ({"vocab_size": None}, "vocab_size is null: a whole number is needed"),
    ({"num_hidden_layers": [2]}, r"num_hidden_layers is \[2\]: a whole number of at least 1"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0: a whole number of at least 1"),
    ({"num_attention_heads": 4.5}, "num_attention_heads is 4.5: a whole number"),
    ({"sliding_window": "4k", "use_sliding_window": True}, 'sliding_window is "4k": a whole number of at least 0'),
    ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps is "1e-6": a number is needed'),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e6x"}}, 'rope_parameters.rope_theta is "1e6x"'),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn rope scaling without factor"),
    ({"rope_scaling": "linear"}, 'rope_scaling is "linear": an object of rope parameters'),
])
def test_config_numbers_of_the_wrong_kind_are_refused_by_name(edit: dict, said: str) -> None:
    """A size given as null, a list, text or a fraction, a count of 0, a rope number as text:
    refused naming the key (they had stopped the start with a bare TypeError or
    ZeroDivisionError, or a head count of 4.5 been cut to 4), before any weight is read."""
    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    d = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    ModelSpec.from_dict(d)
    with pytest.raises(UnsupportedModelError, match="^(config.json's )?" + said):
        ModelSpec.from_dict({**d, **edit})


def test_a_vision_language_config_is_read_at_its_top_level_too() -> None:
    """A ...ForConditionalGeneration config.json: the head is tied as its top level says (what
    transformers' model does), and a quantization_config there is refused by name."""
    from teacher_server.models.spec import ModelSpec, UnsupportedModelError

    text = {"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "tie_word_embeddings": True}
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
          "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    assert ModelSpec.from_dict(vl).tie_word_embeddings is False
    assert ModelSpec.from_dict({**vl, "tie_word_embeddings": True, "text_config": {**text, "tie_word_embeddings": False}
                                }).tie_word_embeddings is True
    assert ModelSpec.from_dict({k: v for k, v in vl.items() if k != "tie_word_embeddings"}).tie_word_embeddings is None
    with pytest.raises(UnsupportedModelError, match="quantized checkpoints"):
        ModelSpec.from_dict({**vl, "quantization_config": {"quant_method": "gptq"}})
