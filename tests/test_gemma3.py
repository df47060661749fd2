"""Gemma 3 teachers on the CPU: the engine's matrix equals transformers' float32 one for the
released 5:1 local/global pattern (windows of 12 keys under sequences of up to 150 tokens,
linear rope scaling on the global layers, the local layers' own rotary base), a final logit
soft-cap, and the text model of a Gemma3ForConditionalGeneration checkpoint; over sequences
chunked at a 32-token budget, prefix-cache hits, the cuDNN backends' plans (global layers on
their whole-sequence calls, windowed ones on varlen) and TP=2 on gloo; the hub's config keys
read as transformers reads them; what is not built is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from attn_util import CpuCudnn
from family_helpers import cpu_engine, lazy_checkpoints, prefix_group
from gemma_glm_ref import make_gemma3_checkpoint
from test_attention_plan import fe_backend  # noqa: F401  (the fixture)
from test_parity import VOCAB, check, family_rng, make_requests

from teacher_server.cache_layout import FULL, SLIDING
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.models.gemma3 import ScaledEmbedding
from teacher_server.models.spec import ModelSpec
from teacher_server.unsupported import UnsupportedModelError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return lazy_checkpoints(tmp_path_factory.mktemp("gemma3"), make_gemma3_checkpoint)


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


@pytest.mark.parametrize("name", ["gemma3", "gemma3_capped", "gemma3_vl"])
def test_parity_cpu(name: str, ckpt) -> None:
    """float32 within 1e-4 of transformers; flat and per-row candidates, edge starts, sequences
    of up to 150 tokens (past the 12-key window) chunked at a 32-token budget."""
    path = ckpt[name]
    reqs = make_requests(family_rng(name))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_transformers_5_names_of_the_vision_language_checkpoint(ckpt, tmp_path) -> None:
    """The same checkpoint under transformers 5's names (``model.language_model.*``,
    ``model.vision_tower.*``, ``model.multi_modal_projector.*``) loads the same text model."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = ckpt["gemma3_vl"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    renamed = {("model." + k.replace("language_model.model.", "language_model.", 1)): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    assert any(k.startswith("model.vision_tower.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reqs = [q for q in make_requests(family_rng("gemma3_vl")) if len(q.token_ids) > 40][:2]
    a, b = engine(src).run_to_completion(reqs), engine(tmp_path).run_to_completion(reqs)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.token_id_logprobs, y.token_id_logprobs)


def test_layers_declare_windows_ropes_and_scale(ckpt) -> None:
    """Five local layers then a global one; each local layer rotates with the local table, the
    global one with the scaled global table; the softmax scale is query_pre_attn_scalar's."""
    eng = engine(ckpt["gemma3"])
    model = eng.runner.model
    assert [c.kind for c in eng.runner.kv.layout.attention] == [SLIDING] * 5 + [FULL]
    assert [layer.self_attn.rope_key for layer in model.layers] == ["local"] * 5 + ["default"]
    assert {layer.self_attn.window for layer in model.layers} == {12, None}
    assert {layer.self_attn.scale for layer in model.layers} == {24 ** -0.5}
    ropes = model.make_ropes(64, torch.device("cpu"))
    # global: base 1e6 and positions / 8 (linear); local: base 1e4, unscaled
    half = model.spec.head_dim // 2
    assert torch.allclose(ropes["default"].table[8, 1], torch.tensor(np.cos(1.0 / 1e6 ** (2 / 32))).float())
    assert torch.allclose(ropes["local"].table[1, 1], torch.tensor(np.cos(1.0 / 1e4 ** (2 / 32))).float())
    assert ropes["local"].table.shape[1] == 2 * half


@pytest.mark.parametrize("backend", ["cudnn", "cudnn_fe"])
def test_fast_backends_take_both_kinds_with_prefix_hits(backend: str, ckpt, fe_backend) -> None:  # noqa: F811
    """The cuDNN backends' plans on the CPU (device calls replaced by float32 math): the
    global layer takes the whole-sequence calls, the windowed ones varlen; chunks and a
    second pass over cached prefixes still match transformers."""
    path = ckpt["gemma3"]
    eng = engine(path)
    cudnn = CpuCudnn(8)
    eng.tuning = dataclasses.replace(eng.tuning, attention=cudnn if backend == "cudnn" else fe_backend(split=cudnn))
    reqs = [q for q in make_requests(np.random.default_rng(3)) if len(q.token_ids) > 40]  # the chunked ones
    check(path, reqs, eng.run_to_completion(reqs))
    again = [ScoreRequest(q.request_id + "b", q.token_ids, q.start, q.candidates, max_tokens=1) for q in reqs]
    results = eng.run_to_completion(again)
    assert sum(r.cached_tokens for r in results) > 0
    check(path, again, results)
    if backend == "cudnn":
        kinds = {type(it).__name__ for _, items in cudnn.plans for it in items}
        assert {"Fresh", "Varlen"} <= kinds, kinds


def test_prefix_hits(ckpt) -> None:
    """A GRPO group computes its 45-token prompt once (past the 12-key window); later members
    start from its cached keys and still match the reference."""
    path = ckpt["gemma3"]
    reqs, results = prefix_group(engine(path, budget=64), VOCAB)
    check(path, reqs, results)


def test_tp2_equals_tp1(ckpt) -> None:
    """Two gloo ranks (heads split, the vocab-parallel scaled embedding and tied head, the
    soft-cap per shard): TP=2 gives TP=1's results, prefix hits and chunks included."""
    from test_tensor_parallel import assert_same, run

    one, hits1 = run(ckpt["gemma3_capped"], 1)
    two, hits2 = run(ckpt["gemma3_capped"], 2)
    assert_same(one, two)
    assert hits2 == hits1 > 0


def test_embedding_scale_rounded_to_the_model_dtype() -> None:
    """sqrt(5376) = 73.32 is 73.5 in bf16, the factor transformers multiplies by."""
    cpu = torch.device("cpu")
    assert ScaledEmbedding(8, 5376, torch.bfloat16, cpu).scale == 73.5
    assert ScaledEmbedding(8, 5376, torch.float32, cpu).scale == pytest.approx(5376 ** 0.5)


HUB_27B_TEXT = {  # the text_config of google/gemma-3-27b-it as published (the hub's key spellings)
    "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262208,
}


def test_spec_reads_the_hub_config() -> None:
    """Gemma-3-27B's vision-language config.json: its text model, 5:1 layers from
    sliding_window_pattern, the global rope (1e6, linear x8) and the local base (1e4)."""
    spec = ModelSpec.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                "text_config": HUB_27B_TEXT, "vision_config": {"hidden_size": 1152}})
    assert spec.family == "gemma3" and spec.num_layers == 62 and spec.vocab_size == 262208
    assert [spec.layer_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert sum(spec.layer_window(i) is None for i in range(62)) == 10
    assert spec.rope_theta == 1e6 and spec.rope_scaling["rope_type"] == "linear" and spec.rope_scaling["factor"] == 8
    assert spec.gemma.local_rope_theta == 1e4 and spec.gemma.query_pre_attn_scalar == 168
    assert spec.zero_centered_norm and spec.qk_norm and spec.gemma.final_logit_softcapping is None


@pytest.mark.parametrize(("keys", "says"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "rope_type='linear'"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
])
def test_refusals_name_what_is_not_built(keys: dict, says: str) -> None:
    d = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100, **keys}
    with pytest.raises(UnsupportedModelError, match=says.replace("(", r"\(")):
        ModelSpec.from_dict(d)


def test_start_up_check_of_the_gemma_stages() -> None:
    """The compiled stages' check passes the eager definitions and names a stage that differs
    (the model then runs every stage eagerly)."""
    from teacher_server.models.gemma3 import check_gemma_stages
    from teacher_server.ops.fused import FusedOps

    ops = FusedOps(kernels=False, compile=False)
    check_gemma_stages(ops, 64, 32, 1e-6, torch.device("cpu"), torch.float32)
    ops.gelu_tanh_mul = lambda gu: gu[:, :32]  # a wrong stage: the ungated gate half
    with pytest.raises(RuntimeError, match="compiled Gemma stage"):
        check_gemma_stages(ops, 64, 32, 1e-6, torch.device("cpu"), torch.float32)
