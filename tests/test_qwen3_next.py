"""Qwen3-Next on the CPU: the engine's matrix equals transformers' float32 one (grouped
in-projections taken apart at load, the expert layer with its gated shared expert and
un-renormalised top-k, a dense layer among the expert ones), chunked at a 32-token budget
(the linear layers' state carried across chunks), with prefix hits, at TP=2 on gloo; the
routing picks transformers' experts. Qwen3.6's configs load as Qwen3.5-MoE."""

from __future__ import annotations

import pytest
import torch
from family_helpers import cpu_engine, prefix_group
from oss_ref import make_qwen3_next_checkpoint
from reference import hf_model
from test_parity import VOCAB, check, family_rng, make_requests

from teacher_server.engine.engine import Engine
from teacher_server.models.spec import ModelSpec


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next") / "tiny")


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


def test_parity_cpu(ckpt) -> None:
    reqs = make_requests(family_rng("qwen3_next"))
    check(ckpt, reqs, engine(ckpt).run_to_completion(reqs))


def test_prefix_hits(ckpt) -> None:
    """Later members of a group start from the cached prompt's KV and linear states."""
    reqs, results = prefix_group(engine(ckpt, budget=64), VOCAB, members=3)
    check(ckpt, reqs, results)


def test_spec_and_routing(ckpt) -> None:
    """The spec reads the expert and hybrid facts; our router picks transformers' experts with
    its (not renormalised) weights."""
    spec = ModelSpec.from_dir(ckpt)
    assert spec.linear_layer_ids == (0, 1, 2) and spec.kv_layer_ids == (3,)
    assert [spec.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    assert spec.num_experts == 8 and not spec.norm_topk_prob and spec.rotary_dim == 4
    theirs = hf_model(ckpt).model.layers[1].mlp.gate
    ours = engine(ckpt).runner.model.layers[1].mlp
    torch.manual_seed(3)
    h = torch.randn(64, 64)
    _, w_ref, ids_ref = theirs(h)
    w, ids = ours.route(h)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    torch.testing.assert_close(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_tp2_equals_tp1(ckpt) -> None:
    """Two gloo ranks (one key head and its two value heads each, from the grouped tensors)."""
    from test_tensor_parallel import assert_same, run

    one, hits1 = run(ckpt, 1)
    two, hits2 = run(ckpt, 2)
    assert_same(one, two)
    assert hits2 == hits1 > 0


# A Qwen3.6-35B-A3B-style config.json (text part; the vision tower's and the MTP layer's keys
# left out): what is known of Qwen3.6 is that it ships under Qwen3.5-MoE's architecture and
# model_type names with Qwen3.5-MoE's keys; the values are Qwen3.5-35B-A3B's shape (Qwen3.6's
# own published numbers were not checked against a downloaded file here).
QWEN3_6 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    },
    "tie_word_embeddings": False,
}


def test_qwen3_6_config_reads_as_qwen3_5_moe() -> None:
    """Qwen3.6 ships under Qwen3.5-MoE's names with no new keys that change the math: it
    reads as Qwen3.5-MoE (every 4th layer full attention, quarter rotary, 256 experts top-8)."""
    spec = ModelSpec.from_dict(QWEN3_6)
    assert spec.architecture == "Qwen3_5MoeForConditionalGeneration" and spec.family == "qwen3_5_moe"
    assert spec.kv_layer_ids == tuple(range(3, 40, 4)) and spec.rotary_dim == 64 and spec.rope_theta == 1e7
    assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == (256, 8, True)


def test_hub_config_reads() -> None:
    """Qwen3-Next-80B-A3B's config.json keys: 48 layers, every 4th full attention with a quarter
    rotary, 512 experts top-10 renormalised, a shared expert, no dense layer."""
    spec = ModelSpec.from_dict({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "partial_rotary_factor": 0.25, "rope_theta": 10000000, "vocab_size": 151936, "max_position_embeddings": 262144,
    })
    assert spec.kv_layer_ids == tuple(range(3, 48, 4)) and spec.rotary_dim == 64 and spec.attn_output_gate
    assert all(spec.is_moe_layer(i) for i in range(48)) and spec.norm_topk_prob and spec.zero_centered_norm
    assert (spec.num_experts, spec.num_experts_per_tok, spec.shared_expert_intermediate_size) == (512, 10, 512)
