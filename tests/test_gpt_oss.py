"""gpt-oss on the CPU: the engine's matrix equals transformers' float32 one (attention sinks,
8-token windows on every other layer under sequences of up to 150 tokens, YaRN, biased
routing and experts with the clamped SwiGLU), chunked at a 32-token budget, with prefix hits,
from plain and from MXFP4-packed experts, at TP=2 on gloo; the routing picks transformers'
experts; the MXFP4 packing reads back as transformers reads it; sinks on the log-sum-exp path
equal the exact softmax."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from family_helpers import cpu_engine, lazy_checkpoints, prefix_group
from oss_ref import GPT_OSS, make_gpt_oss_checkpoint
from reference import hf_model
from test_parity import VOCAB, check, family_rng, make_requests

from teacher_server.attention.sdpa import sdpa_one
from teacher_server.attention.sinks import apply_sinks
from teacher_server.engine.engine import Engine
from teacher_server.layers.formats.mxfp4 import dequantize, quantize
from teacher_server.models.spec import ModelSpec
from teacher_server.unsupported import UnsupportedModelError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return lazy_checkpoints(tmp_path_factory.mktemp("gpt_oss"), make_gpt_oss_checkpoint)


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


def test_parity_cpu(ckpt) -> None:
    """float32 within 1e-4 of transformers; flat and per-row candidates, sequences of up to 150
    tokens (windows of 8) chunked at a 32-token budget; experts read from MXFP4 (the plain
    layout: ``test_prefix_hits``)."""
    path = ckpt["mxfp4"]
    reqs = make_requests(family_rng("gpt_oss"))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_prefix_hits(ckpt) -> None:
    """A GRPO group's later members start from the cached prompt (the windowed layers read the
    prefix's keys through the window) and still match the reference."""
    path = ckpt["plain"]
    reqs, results = prefix_group(engine(path, budget=64), VOCAB)
    check(path, reqs, results)


def test_spec_windows_and_sinks(ckpt) -> None:
    """Sliding and full layers alternate (window 8 where sliding); every layer declares sinks."""
    spec = ModelSpec.from_dir(ckpt["plain"])
    assert [spec.layer_window(i) for i in range(3)] == [8, None, 8]
    assert spec.attention_sinks and spec.swiglu_limit == 7.0 and spec.swiglu_alpha == 1.702
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_theta == 150000.0
    layout = engine(ckpt["plain"]).runner.model.cache_layout()
    assert [(c.kind, c.params.window, c.params.sinks) for c in layout.attention] == [
        ("sliding", 8, True), ("full", None, True), ("sliding", 8, True)]


def test_routing_matches_transformers(ckpt) -> None:
    """Our routing picks transformers' experts with its weights (the router's bias included)."""
    model = hf_model(ckpt["plain"])
    eng = engine(ckpt["plain"])
    ours = eng.runner.model.layers[1].mlp
    theirs = model.model.layers[1].mlp.router
    torch.manual_seed(3)
    h = torch.randn(64, GPT_OSS["hidden_size"])
    _, w_ref, ids_ref = theirs(h)
    w, ids = ours.route(h)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    torch.testing.assert_close(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_mxfp4_packing() -> None:
    """The low nibble is the even element, e8m0 scales 2^(s - 127), e2m1 codes as transformers'
    table; the reference quantizer round-trips values on the grid exactly."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2 | (0xF << 4)  # elements 0 (1.0) and 1 (-6.0)
    blocks[0, 0, 1] = 0x7 | (0x9 << 4)  # elements 2 (6.0) and 3 (-0.5)
    w = dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8))[0]
    assert w[:4].tolist() == [2.0, -12.0, 12.0, -1.0] and not w[4:].any()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 2 + [6.0, 1.0])
    x = torch.stack([grid * 0.25, grid * 8.0])  # [2, 32]
    b, s = quantize(x)
    torch.testing.assert_close(dequantize(b, s), x, rtol=0, atol=0)


def test_sinks_through_the_log_sum_exp() -> None:
    """out * sigmoid(lse - sink) (the fast backends' way) equals the softmax with a sink column
    (sdpa's), windows included."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    sinks = torch.randn(4)
    for window in (None, 5):
        plain = sdpa_one(q, k, v, 0.3, window)
        exact = sdpa_one(q, k, v, 0.3, window, sinks=sinks)
        kk = k.repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
        pos = torch.arange(20)
        mask = pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        lse = s.masked_fill(~mask, float("-inf")).logsumexp(-1)  # [H, T]
        torch.testing.assert_close(apply_sinks(plain, lse, sinks), exact)
        assert not torch.allclose(plain, exact)


def test_tp2_equals_tp1(ckpt) -> None:
    """Two gloo ranks: heads (and their sinks) split, o bias added once, experts and their
    gate/up bias split along the intermediate dimension, the down bias added once. (Within
    1e-4, the parity bound: this model's activations are large on purpose, gate/up past the
    clamp, and the ranks' float32 partial sums round apart by up to ~4e-5, enough to swap the
    ranks of near-tied tokens in the classic prompt_logprobs: the candidates' scores are
    compared.)"""
    from test_tensor_parallel import run

    one, hits1 = run(ckpt["mxfp4"], 1)
    two, hits2 = run(ckpt["mxfp4"], 2)
    for x, y in zip(one, two, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        fin = np.isfinite(x.token_id_logprobs)
        np.testing.assert_array_equal(np.isfinite(y.token_id_logprobs), fin)
        np.testing.assert_allclose(y.token_id_logprobs[fin], x.token_id_logprobs[fin], rtol=0, atol=1e-4)
        assert x.next_token == y.next_token
    assert hits2 == hits1 > 0


@pytest.mark.parametrize(("keys", "says"), [
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_refusals_name_what_is_not_built(keys: dict, says: str) -> None:
    d = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, **keys}
    with pytest.raises(UnsupportedModelError, match=says):
        ModelSpec.from_dict(d)


def test_mxfp4_only_for_gpt_oss() -> None:
    d = {"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        ModelSpec.from_dict(d)


def test_bench_shape_counts_windows_and_every_expert() -> None:
    """The gpt-oss-20b bench shape: ~3.6B active parameters with the embeddings (3.0B without),
    every expert in the checkpoint's bytes (~42 GB in bf16), and a sliding layer's attention
    FLOPs counted over its window only: 2 n w - w^2 pair units instead of n^2."""
    from teacher_server.benchmark.workloads import GPT_OSS_20B, Req, checkpoint_bytes, flops

    spec = ModelSpec.from_dict(GPT_OSS_20B)
    assert 2.9e9 < spec.non_embedding_params() < 3.1e9
    assert 41e9 < checkpoint_bytes(GPT_OSS_20B) < 43e9
    req = [Req(np.zeros(1000, np.int64), 999, np.zeros((0, 1), np.int64))]
    full = dict(GPT_OSS_20B, layer_types=["full_attention"] * 24)
    q, n, w = 64 * 64, 1000, 128
    assert flops(full, req) - flops(GPT_OSS_20B, req) == pytest.approx(2 * q * 12 * (n * n - (2 * n * w - w * w)))


# gpt-oss-20b's config.json as the hub ships it (the keys that matter; layer_types abridged to
# the same alternation by the test).
HUB_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "vocab_size": 201088, "rms_norm_eps": 1e-05,
    "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "max_position_embeddings": 131072, "initial_context_length": 4096, "attention_bias": True,
    "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}


def test_hub_config_reads() -> None:
    """The hub's gpt-oss-20b config: MXFP4 experts, windows on the even layers, YaRN x32."""
    spec = ModelSpec.from_dict(HUB_20B)
    assert spec.weight_format == "mxfp4" and spec.attention_bias and spec.attention_sinks
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (32, 4, 2880)
    assert [spec.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert spec.rope_scaling["factor"] == 32.0 and spec.rope_scaling["truncate"] is False
    assert (spec.q_size, spec.kv_size, spec.vocab_size) == (4096, 512, 201088)
    bare = ModelSpec.from_dict({"architectures": ["GptOssForCausalLM"]})  # transformers' defaults: -120b's shape
    assert (bare.num_layers, bare.num_experts, bare.rope_scaling["rope_type"]) == (36, 128, "yarn")


def test_hub_rope_spelling_without_truncate_reads_as_transformers(tmp_path) -> None:
    """A config in the older spelling (``rope_scaling`` beside a top-level ``rope_theta``) that
    leaves ``truncate`` out takes transformers' YaRN default (truncate), not a key of the
    family's default rope (which read truncate=false under it: scores off by up to 1e-2)."""
    path = make_gpt_oss_checkpoint("plain", tmp_path / "m")
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    rope.pop("truncate")
    d["rope_theta"], d["rope_scaling"] = rope.pop("rope_theta"), rope
    (path / "config.json").write_text(json.dumps(d))
    assert ModelSpec.from_dict(d).rope_scaling.get("truncate", True) is True
    reqs = make_requests(family_rng("gpt_oss"))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_attention_without_biases(tmp_path) -> None:
    """attention_bias=false (transformers builds q, k, v and o without biases) loads and
    matches the reference."""
    path = make_gpt_oss_checkpoint("plain", tmp_path / "m", attention_bias=False)
    assert not ModelSpec.from_dict(json.loads((path / "config.json").read_text())).attention_bias
    reqs = make_requests(family_rng("gpt_oss"))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_start_up_check_of_the_expert_activation(ckpt) -> None:
    """A compiled expert activation that differs from its eager definition (here: no clamp) is
    caught at start-up and every compiled stage then runs eagerly."""
    from teacher_server.ops.clamped_swiglu import clamped_swiglu
    from teacher_server.ops.fused import FusedOps

    model = engine(ckpt["plain"]).runner.model
    ops = FusedOps(kernels=False, compile=False)
    ops.compiled = True  # as if compiled: its checks run
    model.warm_up_ops(ops, model.make_ropes(64, torch.device("cpu")))
    assert ops.compiled and ops.clamped_swiglu is clamped_swiglu
    ops.clamped_swiglu = lambda gu, b, rows, alpha, limit: clamped_swiglu(gu, b, rows, alpha, 1e9)
    model.warm_up_ops(ops, model.make_ropes(64, torch.device("cpu")))
    assert not ops.compiled and ops.clamped_swiglu is clamped_swiglu


def test_start_up_check_of_the_expert_activation_on_an_expert_parallel_rank(ckpt) -> None:
    """An expert-parallel rank holds E / size experts' biases while its routing ids are global:
    the start-up check draws its expert ids among the rank's own bias rows (a global id past
    them is an index error here, a device-side assert that kills the process on CUDA), so a
    correct compiled activation stays on."""
    from torch import nn

    from teacher_server.ops.fused import FusedOps

    model = engine(ckpt["plain"]).runner.model
    for layer in model.layers:  # rank 0 of 2: the first half of the experts' bias rows
        ex = layer.mlp.experts
        ex.gate_up_bias = nn.Parameter(ex.gate_up_bias[:ex.num_experts // 2].clone(), requires_grad=False)
    ops = FusedOps(kernels=False, compile=False)
    ops.compiled = True  # as if compiled: its checks run
    model.warm_up_ops(ops, model.make_ropes(64, torch.device("cpu")))
    assert ops.compiled


def test_mxfp4_checkpoint_edges(tmp_path) -> None:
    """Expert tensors wider than config.json's intermediate_size are a config/weights mismatch
    (they had been cut to the config's width and another model served: error 3.77), packed or
    plain; an intermediate size off the 32-value blocks, its last block zero-padded, loads and
    matches transformers; scales stored as float8_e8m0fnu read as their exponent bytes; another
    packed layout or a NaN scale (255) is refused naming the tensor (bare asserts before)."""
    from teacher_server.layers.formats.mxfp4 import dequantize, quantize

    for name in ("mxfp4", "plain"):
        path = make_gpt_oss_checkpoint(name, tmp_path / name, num_hidden_layers=1)
        d = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**d, "intermediate_size": 32}))
        with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj\S* has 64 .*expected 32.*mismatch"):
            engine(path)
    odd = make_gpt_oss_checkpoint("mxfp4", tmp_path / "odd", intermediate_size=48, num_hidden_layers=1)
    reqs = make_requests(family_rng("gpt_oss"))[:4]
    check(odd, reqs, engine(odd).run_to_completion(reqs))
    blocks, scales = quantize(torch.randn(3, 64))
    if hasattr(torch, "float8_e8m0fnu"):
        torch.testing.assert_close(dequantize(blocks, scales.view(torch.float8_e8m0fnu)), dequantize(blocks, scales))
    for b, s, said in ((blocks.to(torch.int8), scales, "uint8"), (blocks.flatten(-2), scales, "blocks \\[..., G, 16\\]"),
                       (blocks, torch.full_like(scales, 255), "reserves for NaN")):
        with pytest.raises(ValueError, match=f"w1: .*{said}"):
            dequantize(b, s, name="w1")
