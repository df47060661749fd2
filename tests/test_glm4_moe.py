"""GLM-4.5/4.6 teachers on the CPU: the engine's matrix equals transformers' float32 one for
GLM-4.5's kind (q/k norm, expert groups, routed_scaling_factor 2.5) and GLM-4.5-Air's (no q/k
norm, two shared experts' width), with q/k/v biases and rotary on half of each head, over
sequences chunked at a 32-token budget and prefix-cache hits; TP=2 on gloo equals TP=1; the
router picks transformers' experts with its weights; the MTP layer is skipped at load; the
hub's GLM-4.5-Air config reads as published; what is not built is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from family_helpers import cpu_engine, lazy_checkpoints, prefix_group
from gemma_glm_ref import make_glm_checkpoint
from reference import hf_model
from test_parity import VOCAB, check, family_rng, make_requests

from teacher_server.engine.engine import Engine
from teacher_server.layers.deepseek_moe import DeepseekMoe, deepseek_route
from teacher_server.models.spec import ModelSpec
from teacher_server.unsupported import UnsupportedModelError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return lazy_checkpoints(tmp_path_factory.mktemp("glm"), make_glm_checkpoint)


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


@pytest.mark.parametrize("name", ["glm", "glm_air"])
def test_parity_cpu(name: str, ckpt) -> None:
    """float32 within 1e-4 of transformers; flat and per-row candidates, edge starts, sequences
    of up to 150 tokens chunked at a 32-token budget; the first layer dense, the others routed."""
    path = ckpt[name]
    eng = engine(path)
    layers = eng.runner.model.layers
    assert [isinstance(layer.mlp, DeepseekMoe) for layer in layers] == [False, True, True]
    assert hasattr(layers[0].self_attn, "q_norm") == (name == "glm")
    reqs = make_requests(family_rng(name))
    check(path, reqs, eng.run_to_completion(reqs))


def test_prefix_hits(ckpt) -> None:
    """A GRPO group computes its prompt once; later members start from its cached keys."""
    path = ckpt["glm"]
    reqs, results = prefix_group(engine(path, budget=64), VOCAB)
    check(path, reqs, results)


def test_residual_add_in_gemm(ckpt) -> None:
    """The CUDA default (the residual add in the o/down GEMM's epilogue) on the CPU: same results."""
    path = ckpt["glm_air"]
    eng = engine(path)
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    reqs = [q for q in make_requests(family_rng("glm-gemm")) if len(q.token_ids) > 40]
    check(path, reqs, eng.run_to_completion(reqs))


def test_routing_matches_transformers(ckpt) -> None:
    """The same experts with the same weights as transformers' GLM router on the same input;
    the correction bias changes picks (not weights) and the groups are honoured."""
    model = hf_model(ckpt["glm"])
    gate = model.model.layers[1].mlp.gate
    torch.manual_seed(3)
    h = torch.randn(64, 64)
    _, w_ref, ids_ref = gate(h)
    spec = ModelSpec.from_dir(ckpt["glm"])
    r = spec.routing
    assert (r.scoring, r.n_group, r.topk_group, r.routed_scaling_factor) == ("sigmoid", 2, 1, 2.5)
    logits = torch.nn.functional.linear(h, gate.weight)
    args = (spec.num_experts_per_tok, r.scoring, r.n_group, r.topk_group, spec.norm_topk_prob, r.routed_scaling_factor)
    w, ids = deepseek_route(logits, gate.e_score_correction_bias, *args)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    torch.testing.assert_close(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))
    plain = deepseek_route(logits, None, *args)[1]
    assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)
    assert ((ids // 4).amin(-1) == (ids // 4).amax(-1)).all()  # top-1 group of 4 experts: all from one group


def test_tp2_equals_tp1(ckpt) -> None:
    """Two gloo ranks: heads (and their biases, q/k norms) split, experts and the shared MLP
    split along their intermediate dimension; TP=2 gives TP=1's results."""
    from test_tensor_parallel import assert_same, run

    one, hits1 = run(ckpt["glm"], 1)
    two, hits2 = run(ckpt["glm"], 2)
    assert_same(one, two)
    assert hits2 == hits1 > 0


HUB_AIR = {  # zai-org/GLM-4.5-Air's config.json as published (its keys)
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
    "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False, "vocab_size": 151552,
}


def test_spec_reads_glm_4_5_air() -> None:
    """Rotary on 64 of 128 dims, q/k/v biases, no q/k norm, layer 0 dense, 128 experts top-8
    and one shared expert of 1408; active parameters count top-8 and the shared MLP."""
    spec = ModelSpec.from_dict(HUB_AIR)
    assert spec.family == "glm4_moe" and spec.rotary_dim == 64 and spec.attention_bias and not spec.qk_norm
    assert spec.mlp_only_layers == (0,) and spec.num_experts == 128 and spec.shared_expert_intermediate_size == 1408
    h = 4096
    attn = h * (96 * 128 + 2 * 8 * 128) + 96 * 128 * h
    moe = h * 128 + 3 * h * 1408 * 8 + 3 * h * 1408
    assert spec.non_embedding_params() == 46 * attn + 3 * h * 10944 + 45 * moe
    assert ModelSpec.from_dict({**HUB_AIR, "use_qk_norm": True}).qk_norm  # GLM-4.5's


@pytest.mark.parametrize(("keys", "says"), [
    ({"n_group": 3}, "n_group=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"head_dim": 10}, "partial_rotary_factor=0.5 of head_dim 10"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
])
def test_refusals_name_what_is_not_built(keys: dict, says: str) -> None:
    with pytest.raises(UnsupportedModelError, match=says.replace("(", r"\(")):
        ModelSpec.from_dict({**HUB_AIR, **keys})


def test_start_up_check_of_the_partial_rotary_stage() -> None:
    """The q/k stage's check passes the eager definition and names one that rotates the whole head."""
    from teacher_server.layers.rotary import RotaryEmbedding
    from teacher_server.ops.partial_rope import check_partial_qk_prep, partial_qk_prep
    from teacher_server.ops.qkv_rope import HeadLayout, qkv_prep

    cpu = torch.device("cpu")
    table = RotaryEmbedding(16, 1e4, {"rope_type": "default"}, 100, 100, cpu).table  # rotary on 16 of 32 dims
    heads = HeadLayout(4, 2, 32, 1e-6)
    check_partial_qk_prep(partial_qk_prep, heads, torch.ones(32), torch.ones(32), table, cpu, torch.float32)

    def whole(qkv, cs, qn, kn, n_q, n_kv, d, eps):  # rotates all 32 dims
        return qkv_prep(qkv, cs[:, None, :8].repeat(1, 1, 2), cs[:, None, 8:].repeat(1, 1, 2), qn, kn, n_q, n_kv, d, eps)

    with pytest.raises(RuntimeError, match="compiled partial_qk_prep"):
        check_partial_qk_prep(whole, heads, None, None, table, cpu, torch.float32)
