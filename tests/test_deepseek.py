"""DeepSeek-V2/V3-class teachers on the CPU: the engine's matrix equals transformers' float32 one
for V3 (with and without q low-rank, with and without expert groups, YaRN with its softmax
correction, interleaved and half-split rope), Kimi-K2's config spelling, V2 (softmax routing,
group-limited and greedy), over long sequences split into chunks at a 32-token budget and
GRPO groups started from cached prefix latents; the pool keeps 576-style latents only; the
routing picks transformers' experts; what is not built is refused by name."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from deepseek_ref import CONFIGS, make_deepseek_checkpoint
from family_helpers import cpu_engine, lazy_checkpoints, prefix_group
from reference import hf_model
from test_parity import VOCAB, check, family_rng, make_requests

from teacher_server.attention.base import AttentionInputs
from teacher_server.cache_layout import LATENT
from teacher_server.engine.engine import Engine
from teacher_server.layers.deepseek_moe import deepseek_route
from teacher_server.models.spec import ModelSpec
from teacher_server.unsupported import UnsupportedModelError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return lazy_checkpoints(tmp_path_factory.mktemp("deepseek"), make_deepseek_checkpoint)


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_cpu(name: str, ckpt) -> None:
    """float32 within 1e-4 of transformers; flat and per-row candidates, edge starts, sequences
    of up to 150 tokens chunked at a 32-token budget (later chunks read earlier latents)."""
    path = ckpt[name]
    reqs = make_requests(family_rng(name))
    check(path, reqs, engine(path).run_to_completion(reqs))


@pytest.mark.parametrize("name", ["v3", "v2lite"])
def test_prefix_hits(name: str, ckpt) -> None:
    """A GRPO group computes its prompt once; later members start from its cached latents and
    still match the reference."""
    path = ckpt[name]
    reqs, results = prefix_group(engine(path, budget=64), VOCAB)
    check(path, reqs, results)


def test_only_the_configured_multi_token_prediction_layers_are_passed_over(ckpt, tmp_path) -> None:
    """A layer after the last that config.json's num_nextn_predict_layers does not declare (a
    checkpoint of 4 layers, a config of 3): refused as a mismatch. Every layer past
    num_hidden_layers had been passed over as an MTP layer, and a truncated model served."""
    import json
    import shutil

    shutil.copytree(ckpt["v3"], tmp_path / "m")
    cfg = tmp_path / "m" / "config.json"
    d = json.loads(cfg.read_text())
    assert ModelSpec.from_dict(d).mtp_layers == 1
    d.pop("num_nextn_predict_layers")
    cfg.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.\S+ has no place .*config/weights mismatch"):
        engine(tmp_path / "m")


def test_pool_keeps_the_latent_only(ckpt) -> None:
    """Every layer declares a latent cache of kv_lora_rank + qk_rope_head_dim per token, one
    head and no values; the pool's bytes per token are that, not per-head keys and values."""
    eng = engine(ckpt["v3"])
    layout = eng.runner.model.cache_layout()
    assert [c.kind for c in layout.attention] == [LATENT] * 3
    assert {(c.heads, c.k_dim, c.v_dim) for c in layout.attention} == {(1, 32 + 16, 0)}
    assert layout.attention[0].attn_shape == (4, 48, 24)
    assert layout.bytes_per_token() == 3 * 48 * 4  # float32
    assert eng.runner.kv.v_cache(0) is None


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_routing_matches_transformers(name: str, ckpt) -> None:
    """Our routing picks the same experts with the same weights as transformers' router on the
    same router input (the V3 correction bias changes picks, not weights)."""
    model = hf_model(ckpt[name])
    gate = model.model.layers[1].mlp.gate
    torch.manual_seed(3)
    h = torch.randn(64, 64)
    _, w_ref, ids_ref = gate(h)
    spec = ModelSpec.from_dir(ckpt[name])
    r = spec.routing
    logits = torch.nn.functional.linear(h, gate.weight)
    bias = getattr(gate, "e_score_correction_bias", None)
    w, ids = deepseek_route(logits, bias, spec.num_experts_per_tok, r.scoring, r.n_group, r.topk_group,
                            spec.norm_topk_prob, r.routed_scaling_factor)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    torch.testing.assert_close(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))
    if bias is not None:  # the bias matters here: without it other experts win somewhere
        plain = deepseek_route(logits, None, spec.num_experts_per_tok, r.scoring, r.n_group, r.topk_group,
                               spec.norm_topk_prob, r.routed_scaling_factor)[1]
        assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def test_spec_reads_kimi_and_active_params(ckpt) -> None:
    """Kimi-K2's config (model_type kimi_k2, old rope keys) reads as DeepSeek-V3; active
    parameters count the top-k experts and the ungated shared MLP, not all experts."""
    spec = ModelSpec.from_dir(ckpt["kimi"])
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.head_dim == 48 and spec.rotary_dim == 16
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_theta == 10000.0
    assert spec.mlp_only_layers == (0,) and spec.shared_expert_intermediate_size == 32
    h, m = 64, spec.mla
    attn = h * 48 + 48 * 4 * 48 + h * 48 + 32 * 4 * (32 + 24) + 4 * 24 * h
    moe = h * 12 + 3 * h * 32 * 4 + 3 * h * 32
    assert m.latent == 48 and spec.non_embedding_params() == 3 * attn + 3 * h * 96 + 2 * moe


@pytest.mark.parametrize(("keys", "says"), [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"n_group": 3}, "n_group=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_refusals_name_what_is_not_built(keys: dict, says: str) -> None:
    d = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100, **keys}
    with pytest.raises(UnsupportedModelError, match=says.replace("(", r"\(")):
        ModelSpec.from_dict(d)


def test_residual_add_in_gemm(ckpt) -> None:
    """The CUDA default (the residual add in the o/down GEMM's epilogue) on the CPU: same results."""
    path = ckpt["v3"]
    eng = engine(path)
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    reqs = make_requests(np.random.default_rng(4))
    check(path, reqs, eng.run_to_completion(reqs))


def test_tp2_equals_tp1(ckpt) -> None:
    """Two gloo ranks: heads of q/q_b and kv_b split, o row-parallel, the latent projection and
    the latent cache whole on each rank, experts and the shared MLP split along their
    intermediate dimension; TP=2 gives TP=1's results (prefix hits and chunks included)."""
    from test_tensor_parallel import assert_same, run

    one, hits1 = run(ckpt["v3"], 1)
    two, hits2 = run(ckpt["v3"], 2)
    assert_same(one, two)
    assert hits2 == hits1 > 0


def test_rope_rows_permuted_at_load_whole_or_sliced() -> None:
    """Interleaved rope rows become halves in every head (the unrotated rows stay), whether the
    rank reads the whole tensor or its slice of heads; fp8 weights are moved as bytes."""
    from teacher_server.layers.parallel import TensorParallel
    from teacher_server.models.mla import RopeRowsLinear

    def layer(rank: int) -> RopeRowsLinear:
        return RopeRowsLinear(4, {"q": 2 * 6}, False, torch.float32, torch.device("cpu"), TensorParallel(2, rank),
                              units={"q": 6}, rope_rows={"q": (6, 2, 4)}, interleaved=True)

    w = torch.arange(12.0)[:, None].repeat(1, 4)  # row r holds r
    for rank in (0, 1):
        a, b = layer(rank), layer(rank)
        a.load_weight("weight", w, "q", "q_proj.weight")
        b.load_weight("weight", w[6 * rank:6 * rank + 6], "q", "q_proj.weight")
        base = 6 * rank
        want = torch.tensor([0, 1, 2, 4, 3, 5], dtype=torch.float32) + base
        torch.testing.assert_close(a.weight[:, 0], want)
        torch.testing.assert_close(b.weight[:, 0], want)
    raw = torch.arange(12, dtype=torch.uint8)[:, None].repeat(1, 4).view(torch.float8_e4m3fn)
    fp8 = RopeRowsLinear(4, {"q": 12}, False, torch.float8_e4m3fn, torch.device("cpu"), units={"q": 6},
                         rope_rows={"q": (6, 2, 4)}, interleaved=True)
    fp8.load_weight("weight", raw, "q", "q_proj.weight")
    assert fp8.weight.view(torch.uint8)[:, 0].tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_values_padded_to_the_key_width_give_the_same_scores(ckpt, monkeypatch) -> None:
    """A backend that takes no values narrower than keys (the GPU ones) gets v zero-padded to
    the key width and its output cut back: the same scores (prefixed chunks included)."""
    from teacher_server.attention.sdpa import SdpaBackend

    monkeypatch.setattr(SdpaBackend, "distinct_v_width", False)
    seen = []
    real = SdpaBackend.__call__

    def spy(self: SdpaBackend, x: AttentionInputs, *a: object, **kw: object) -> torch.Tensor:
        seen.append((x.v.shape[2], None if x.vp is None else x.vp.shape[2]))
        return real(self, x, *a, **kw)

    monkeypatch.setattr(SdpaBackend, "__call__", spy)
    path = ckpt["v3"]
    reqs = make_requests(family_rng("v3-padded"))
    check(path, reqs, engine(path).run_to_completion(reqs))
    assert {v for v, _ in seen} == {48} and {vp for _, vp in seen} == {None, 48}  # padded from 24 to q/k's 48


@pytest.mark.parametrize("name", ["v3_noq", "v3"])
def test_q_and_values_reach_a_backend_that_takes_views_as_views(name: str, ckpt, monkeypatch) -> None:
    """A backend that takes views (the CPU's sdpa; cudnn_fe on the GPU) gets q rotated where
    its projection wrote it (without a q low rank: inside the a-projection's output, rows as
    wide as it) and the values inside kv_b_proj's output, at the strides the layer declares
    (``AttentionCache.views``, what warm-up builds graphs for); a step with prefixed tokens
    copies its fresh values as before. The scores are the reference's, and those of a backend
    that takes no views."""
    from teacher_server.attention.sdpa import SdpaBackend

    seen = []
    real = SdpaBackend.__call__

    def spy(self: SdpaBackend, x: AttentionInputs, ctx, *a: object, **kw: object) -> torch.Tensor:
        seen.append((x.q.stride(), x.v.stride(), ctx.tok_prefixed))
        return real(self, x, ctx, *a, **kw)

    monkeypatch.setattr(SdpaBackend, "__call__", spy)
    path = ckpt[name]
    reqs = make_requests(family_rng(f"{name}-views"))
    eng = engine(path)
    views = eng.runner.model.cache_layout().attention[0].views
    viewed = eng.run_to_completion(reqs)
    check(path, reqs, viewed)
    assert {q for q, _, _ in seen} == {views[0]}  # every call: q where it was made
    assert {v for _, v, first in seen if not first} == {views[1]}  # values read from kv_b_proj's output
    assert views[0][0] == 4 * 48 + (32 + 16 if name == "v3_noq" else 0)  # (q_in_a: the a-projection's rows)
    assert any(first for *_, first in seen) and any(not first for *_, first in seen)  # (both kinds of step ran)
    monkeypatch.setattr(SdpaBackend, "takes_views", False)
    seen.clear()
    plain = engine(path).run_to_completion(reqs)
    assert all(q == (4 * 48, 48, 1) and (first or v == (4 * 24, 24, 1)) for q, v, first in seen)
    for a, b in zip(viewed, plain):
        np.testing.assert_allclose(a.token_id_logprobs, b.token_id_logprobs, rtol=0, atol=1e-5)


def test_latent_stages_compiled_match_their_definitions_and_a_wrong_one_is_caught() -> None:
    """The latent attention stages through torch.compile (as ``FusedOps`` compiles them) pass
    the start-up check at a V3-like shape (q/k 192, v 128, latent 512 | 64); a stage that
    leaves the shared rotated key out of the keys fails it."""
    from teacher_server.ops.mla_prep import check_mla_stages, mla_expand, mla_prep

    torch.manual_seed(0)
    table = torch.cat([torch.cos(torch.arange(64.0)[:, None] * torch.rand(32)),
                       torch.sin(torch.arange(64.0)[:, None] * torch.rand(32))], dim=1)
    w = 1 + 0.1 * torch.randn(512, dtype=torch.bfloat16)
    args = (96 + 576, 4, 128, 64, 128, 512, w, 1e-6, table, torch.device("cpu"), torch.bfloat16)
    prep, expand = (torch.compile(f, fullgraph=True) for f in (mla_prep, mla_expand))
    check_mla_stages(prep, expand, *args, views=True)
    # q as the first columns of the a-projection's output (no q low rank, one rank: one GEMM)
    check_mla_stages(prep, expand, 4 * 192 + 576, *args[1:], q_in_a=True, views=True)

    def no_shared_key(kv, pe, k, v) -> None:
        mla_expand(kv, torch.zeros_like(pe), k, v)

    with pytest.raises(RuntimeError, match="mla_expand keys"):
        check_mla_stages(mla_prep, no_shared_key, *args)

    def unrotated(a, q, cs, w, eps, rank, rope_only=False, heads=0):  # q's rotated dims handed back as they were
        latent, rot = mla_prep(a, q, cs, w, eps, rank, rope_only, heads)
        if rope_only:
            q = a[:, :a.shape[1] - rank - cs.shape[1]].view(a.shape[0], heads, -1) if q is None else q
            rot = q[..., q.shape[-1] - rot.shape[-1]:].clone()
        return latent, rot

    with pytest.raises(RuntimeError, match="in place, q"):
        check_mla_stages(unrotated, mla_expand, *args, views=True)


def test_without_a_q_low_rank_q_and_the_latent_are_one_gemm_on_one_rank(ckpt) -> None:
    """Moonlight / V2-Lite (no q_lora_rank) at one rank: q_proj's checkpoint tensor loads as the
    first part of the a-projection, whose one GEMM makes q and the latent (``test_parity_cpu``
    scores such checkpoints against transformers); with q low-rank, q stays apart."""
    for name, merged in (("v3_noq", True), ("v2lite", True), ("v3", False)):
        attn = engine(ckpt[name]).runner.model.layers[0].self_attn
        assert attn.q_in_a == merged and (attn.q_proj is None) == (attn.q_b_proj is not None or merged)
        if merged:
            assert attn.qkv_a_proj.weight.shape[0] == attn.n * attn.mla.qk_dim + attn.mla.latent
