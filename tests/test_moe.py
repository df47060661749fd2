"""Mixture-of-experts teachers: the engine's matrix equals transformers' float32 one for every
MoE family (both checkpoint layouts, flat and per-row candidates, chunked sequences, prefix
hits), the routing picks the experts transformers picks (far from the decision boundary),
the grouped GEMM paths agree with their reference, and the spec counts active parameters."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from family_helpers import cpu_engine, prefix_group
from reference import MOE_FAMILIES, errors_vs_reference, hf_model
from test_parity import VOCAB, check, family_rng, long_requests, make_requests

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.layers.moe import SparseMoe
from teacher_server.layers.runtime import Runtime
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import (
    GroupedGemm,
    check_grouped_mm,
    grouped_mm,
    grouped_mm_reference,
    padded_grouped_mm,
)


def engine(path, budget: int = 32, **kw) -> Engine:
    return cpu_engine(path, budget, **kw)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_parity_cpu(family: str, checkpoints) -> None:
    """float32 within 1e-4 of transformers; flat and per-row candidates, edge starts, long
    sequences chunked at a 32-token budget."""
    path = checkpoints[family]
    reqs = make_requests(family_rng(family))
    check(path, reqs, engine(path).run_to_completion(reqs))


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe"])
def test_moe_parity_residual_add_in_gemm(family: str, checkpoints) -> None:
    """The CUDA default (residual add inside the o/down GEMM, the shared expert's down GEMM
    adding into the routed output) on the CPU: same results."""
    path = checkpoints[family]
    eng = engine(path)
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    reqs = make_requests(np.random.default_rng(4))
    check(path, reqs, eng.run_to_completion(reqs))


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_moe_prefix_hits(family: str, checkpoints) -> None:
    """A GRPO-like group (one prompt, several responses) computes the prompt once and the
    later members, started from cached prefix blocks, still match the reference."""
    path = checkpoints[family]
    reqs, results = prefix_group(engine(path, budget=64), VOCAB, min_cached=1)
    check(path, reqs, results)


def hf_routing(path, token_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per routed layer: (router input [T, hidden], chosen experts [T, k]) of transformers'
    float32 forward."""
    model = hf_model(path)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(mod, args, out, i=i) -> None:
            seen[i] = (args[0].reshape(-1, args[0].shape[-1]).detach(), out[2].detach())

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral"])
def test_routing_matches_transformers(family: str, checkpoints) -> None:
    """On transformers' own router inputs our router picks the same experts, and the k-th and
    (k+1)-th router logits are far apart (so the float32 parity above is not luck)."""
    path = checkpoints[family]
    spec = ModelSpec.from_dir(path)
    model = load_model(path, spec, torch.float32, torch.device("cpu"))
    toks = np.random.default_rng(2).integers(0, VOCAB, 120).tolist()
    routed = hf_routing(path, toks)
    assert sorted(routed) == [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    for i, (h, theirs) in routed.items():
        moe = model.layers[i].mlp
        w, ours = moe.route(h)
        torch.testing.assert_close(ours.sort(-1).values, theirs.sort(-1).values, rtol=0, atol=0)
        logits = moe.gate(h).sort(-1, descending=True).values  # softmax is monotonic: compare logits
        k = spec.num_experts_per_tok
        assert float((logits[:, k - 1] - logits[:, k]).min()) > 1e-3  # float32 noise is ~1e-6
        if spec.norm_topk_prob:
            torch.testing.assert_close(w.sum(-1), torch.ones(len(toks)))


def bound_moe(shared: int = 0, gemm: GroupedGemm | None = None, seed: int = 0) -> SparseMoe:
    """A random float32 expert layer (16 experts, top-4) bound to eager CPU ops."""
    torch.manual_seed(seed)
    moe = SparseMoe(32, 16, 4, 24, True, shared, gemm or GroupedGemm(), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    moe.bind(Runtime(None, FusedOps(kernels=False, compile=False), None, None))  # type: ignore[arg-type]
    return moe


@pytest.mark.parametrize("shared", [0, 40])
@pytest.mark.parametrize("tokens", [1, 3, 50])
def test_sparse_moe_matches_loop_over_experts(shared: int, tokens: int) -> None:
    """The grouped forward (sorted rows, two grouped GEMMs, the weighted combine) equals the
    loop over experts, also with experts no token picks (few tokens)."""
    moe = bound_moe(shared)
    h = torch.randn(tokens, 32)
    torch.testing.assert_close(moe(h), moe.reference(h), rtol=1e-5, atol=1e-5)


def test_shared_expert_takes_the_fused_gate_up_kernel_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused gate/up + SiLU kernel runs (Hopper), the shared expert's activation comes
    from it, at the shared width, and the gated layer's output is unchanged; warm-up checks the
    kernel at that width too."""
    from teacher_server.models.moe import check_shared_expert
    from teacher_server.ops.silu_mul import silu_mul_reference

    moe = bound_moe(shared=40)
    h = torch.randn(23, 32)
    plain = moe(h)
    seen = []

    def fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(w.shape))
        return silu_mul_reference(x @ w.t())

    ops = moe.rt.ops
    monkeypatch.setattr(ops, "gate_up_act", fused)
    torch.testing.assert_close(moe(h), plain, rtol=1e-6, atol=1e-6)
    assert seen == [(80, 32)]  # the shared expert's [gate; up], nothing else
    checked = []
    monkeypatch.setattr("teacher_server.ops.fused.check_gate_up_silu", lambda *a: checked.append(a[:2]) or True)
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    check_shared_expert(ops, moe, 32, torch.device("cpu"), torch.float32)
    check_shared_expert(ops, moe, 32, torch.device("cpu"), torch.float32)  # (a second layer: checked once)
    assert checked == [(32, 40)] and ops.gate_up_kernel

    def wrong(*a: object) -> bool:
        raise RuntimeError("mismatch")

    monkeypatch.setattr("teacher_server.ops.fused.check_gate_up_silu", wrong)
    ops.check_gate_up_width(32, 48, torch.device("cpu"), torch.float32)
    assert not ops.gate_up_kernel  # a failure at the shared width turns it off everywhere
    monkeypatch.setattr("teacher_server.ops.fused.check_gate_up_silu", lambda *a: True)
    ops.check_gate_up_width(32, 56, torch.device("cpu"), torch.float32)
    assert not ops.gate_up_kernel  # for good: a later width it takes does not turn it back on


def test_a_shared_expert_width_the_kernel_takes_turns_it_on_after_a_dense_width_it_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-4.5-Air: the dense layers' width (10,944) is one the fused gate/up kernel does not
    take, so the warm-up's first check leaves it off; the shared experts' width (1,408), which
    it takes and passes, turns it back on (the dense layers then take the two passes, call by
    call); a shared width it does not take leaves it as it was."""
    takes = {1408: True, 10944: False, 100: False}
    monkeypatch.setattr("teacher_server.ops.fused.check_gate_up_silu", lambda h, i, *a: takes[i])
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    ops.check_gate_up(4096, 10944, torch.device("cpu"), torch.bfloat16)
    assert not ops.gate_up_kernel
    ops.check_gate_up_width(4096, 100, torch.device("cpu"), torch.bfloat16)
    assert not ops.gate_up_kernel
    ops.check_gate_up_width(4096, 1408, torch.device("cpu"), torch.bfloat16)
    assert ops.gate_up_kernel
    ops.check_gate_up_width(4096, 100, torch.device("cpu"), torch.bfloat16)
    assert ops.gate_up_kernel  # a width it does not take is left to the two passes, the switch stays on
    off = FusedOps(kernels=False, compile=False)
    off.check_gate_up_width(4096, 1408, torch.device("cpu"), torch.bfloat16)
    assert not off.gate_up_kernel  # never on where the kernels are off
    by_hand = FusedOps(kernels=True, compile=False, kernels_available=lambda: False)
    by_hand.refuse("gate_up_kernel")  # a family whose MLP the SiLU variant does not fit (Gemma)
    by_hand.check_gate_up_width(4096, 1408, torch.device("cpu"), torch.bfloat16)
    assert not by_hand.gate_up_kernel  # a later width's check does not turn it back on


def test_padded_fallback_gives_the_same_layer_output() -> None:
    """With torch's grouped GEMM refused, the padded bmm fallback computes the same output."""
    fast, slow = GroupedGemm(), GroupedGemm(allow_torch=False)  # as if its check had failed
    h = torch.randn(37, 32)
    torch.testing.assert_close(bound_moe(gemm=slow)(h), bound_moe(gemm=fast)(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [grouped_mm, padded_grouped_mm])
def test_grouped_mm_paths_match_reference(fn) -> None:
    gen = torch.Generator().manual_seed(3)
    counts = [0, 9, 0, 0, 30, 2, 1, 0]  # empty groups first, inside and last
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), 24, generator=gen)
    b = torch.randn(len(counts), 40, 24, generator=gen).transpose(1, 2)  # a transposed view, as the experts pass it
    torch.testing.assert_close(fn(a, b, offs), grouped_mm_reference(a, b, offs), rtol=1e-5, atol=1e-5)
    check_grouped_mm(fn, 16, 8, torch.device("cpu"), torch.float32)


def test_stacked_and_per_expert_layouts_load_the_same(checkpoints, tmp_path) -> None:
    """A hub checkpoint (one tensor per expert) and transformers' stacked layout of the same
    weights give the same model; a missing expert tensor is an error that names it."""
    from safetensors.torch import load_file, save_file

    per, stacked = checkpoints["qwen3moe"], checkpoints["qwen3moe_stacked"]  # same seed, same weights
    spec = ModelSpec.from_dir(per)
    a = load_model(per, spec, torch.float32, torch.device("cpu")).state_dict()
    b = load_model(stacked, spec, torch.float32, torch.device("cpu")).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    for f in per.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(per / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_up"):
        load_model(tmp_path, spec, torch.float32, torch.device("cpu"))


def test_spec_moe_facts_and_active_params() -> None:
    """Qwen3-30B-A3B's config.json: 128 experts, top-8, all layers routed; active parameters
    ~3.3B in all (published), of which ~2.7B outside the embedding and LM head."""
    d = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "rope_theta": 1000000.0, "tie_word_embeddings": False}
    s = ModelSpec.from_dict(d)
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size, s.norm_topk_prob) == (128, 8, 768, True)
    assert all(s.is_moe_layer(i) for i in range(48))
    active = s.non_embedding_params()
    assert 2.6e9 < active < 2.8e9 and 3.2e9 < active + 2 * 151936 * 2048 < 3.4e9
    # dense layers count the dense MLP: mlp_only_layers and the sparse step
    dense = ModelSpec.from_dict({**d, "mlp_only_layers": [0, 1], "decoder_sparse_step": 2})
    assert [dense.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    # 25 dense layers: a 6144-wide MLP (3 h 6144) instead of router + 8 experts (h 128 + 8 x 3 h 768)
    assert dense.non_embedding_params() == active - 25 * 2048 * 128
    # Mixtral always renormalises; newer configs name the expert count num_local_experts
    mix = ModelSpec.from_dict({**d, "architectures": ["MixtralForCausalLM"], "num_experts": None,
                               "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": None,
                               "moe_intermediate_size": None, "intermediate_size": 14336})
    assert (mix.num_experts, mix.moe_intermediate_size, mix.norm_topk_prob) == (8, 14336, True)


# --- on the GPU ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_mm_matches_reference(dtype: torch.dtype) -> None:
    """At the 30B-A3B expert shapes (2048 -> 1536, 768 -> 2048), uneven and empty groups: the
    padded fallback always matches the reference; torch's grouped GEMM is taken in bf16 on
    Hopper (and then matches), elsewhere only where it passed its check."""
    dev = torch.device("cuda")
    shapes = ((2048, 1536), (768, 2048))
    fast = GroupedGemm().use_torch(dev, dtype, shapes)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] == 9:
        assert fast
    for k, n in shapes:
        check_grouped_mm(padded_grouped_mm, k, n, dev, dtype)
        if fast:
            check_grouped_mm(grouped_mm, k, n, dev, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral"])
def test_moe_parity_gpu_float32(family: str, checkpoints) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cuda", dtype="float32", max_num_batched_tokens=32,
                        block_size=8, num_kv_blocks=256, max_model_len=512))
    reqs = make_requests(np.random.default_rng(7))
    check(path, reqs, eng.run_to_completion(reqs), tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral"])
def test_moe_parity_gpu_bfloat16(family: str, checkpoints) -> None:
    """bf16 weights vs the float32 reference: our mean abs error is no larger than that of
    transformers' own bf16 forward on the same weights (its grouped-GEMM experts)."""
    import transformers as tf

    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=512,
                        block_size=16, num_kv_blocks=512, max_model_len=2048))
    reqs = make_requests(np.random.default_rng(11)) + long_requests(np.random.default_rng(5))
    results = eng.run_to_completion(reqs)
    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    ours_mae, theirs_mae = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    print(f"{family}: bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae, (ours_mae, theirs_mae)


def tiny_moe(path, cls_name: str, seed: int = 0, **kw):
    """A tiny random MoE checkpoint from a transformers config class (large router weights,
    as ``reference.make_moe_checkpoint``), and its float32 reference model registered for
    ``check`` with its experts run as a loop."""
    import transformers as tf
    from reference import _MODELS, ROUTER, randomize_weights

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6)
    cfg = getattr(tf, cls_name.replace("ForCausalLM", "Config"))(**{**common, **kw})
    torch.manual_seed(seed)
    model = getattr(tf, cls_name)(cfg).to(torch.float32).eval()
    randomize_weights(model, (ROUTER,))
    model.save_pretrained(path, safe_serialization=True)
    _MODELS[f"{path}:{torch.float32}"] = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    return path


def test_expert_widths_torch_grouped_gemm_refuses_take_the_fallback(tmp_path) -> None:
    """A float32 expert 10 wide (rows of 40 bytes: torch's grouped GEMM wants multiples of 16)
    on the CPU: the shape is checked on first use and its GEMMs take the padded bmm, so the
    engine scores as transformers does instead of failing every request."""
    path = tiny_moe(tmp_path / "m", "Qwen3MoeForCausalLM", head_dim=16, intermediate_size=96,
                    moe_intermediate_size=10, num_experts=4, num_experts_per_tok=2)
    reqs = make_requests(np.random.default_rng(5))
    check(path, reqs, engine(path).run_to_completion(reqs))
    gemm = GroupedGemm()
    assert gemm.use_torch(torch.device("cpu"), torch.float32, ((64, 48), (48, 64))) == gemm.use_torch(
        torch.device("cpu"), torch.float32, ((64, 48),))
    assert not gemm.use_torch(torch.device("cpu"), torch.float32, ((64, 20), (10, 64)))  # not the first shapes' answer


def test_a_zero_width_shared_expert_is_no_shared_expert(tmp_path) -> None:
    """Qwen2-MoE with shared_expert_intermediate_size 0: transformers' shared expert adds zero;
    the engine loads the checkpoint (its [0, 64] tensors and the gate are not read) and scores
    the same."""
    path = tiny_moe(tmp_path / "m", "Qwen2MoeForCausalLM", intermediate_size=96, moe_intermediate_size=32,
                    num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=0)
    reqs = make_requests(np.random.default_rng(6))
    check(path, reqs, engine(path).run_to_completion(reqs))


def test_shared_expert_weights_where_the_config_gives_none_are_refused(checkpoints, tmp_path) -> None:
    """A shared expert 48 wide in the files and none in config.json (width 0; Qwen3-MoE has none):
    its tensors had been passed over and another model served. Refused by name, as transformers
    refuses it."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["qwen3moe"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    spec = ModelSpec.from_dir(src)
    name = "model.layers.1.mlp.shared_expert.gate_proj.weight"
    save_file({**tensors, name: torch.randn(48, spec.hidden_size)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name} is \[48, {spec.hidden_size}\], a shared expert's weights, but "
                                         "config.json gives no shared expert"):
        load_model(tmp_path, spec, torch.float32, torch.device("cpu"))
    e = spec.num_experts  # an expert past config.json's count: an error, not an assert (gone under python -O)
    name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
    save_file({**tensors, name: torch.randn(spec.hidden_size, spec.moe_intermediate_size)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^checkpoint tensor {name}: expert {e} outside 0\.\.{e - 1}"):
        load_model(tmp_path, spec, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_sparse_step_keys_apply_only_where_transformers_reads_them(arch: str) -> None:
    """decoder_sparse_step / mlp_only_layers make Qwen2/3-MoE layers dense; transformers'
    Mixtral and Qwen3.5-MoE route every layer whatever they say, and so does the spec. A step
    below 1 is refused by name (transformers divides by it)."""
    d = {"architectures": [arch], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
         "linear_value_head_dim": 8, "mlp_only_layers": [1], "decoder_sparse_step": 2}
    assert all(ModelSpec.from_dict(d).is_moe_layer(i) for i in range(4))
    q3 = ModelSpec.from_dict({**d, "architectures": ["Qwen3MoeForCausalLM"]})
    assert [q3.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    from teacher_server.models.spec import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step=0"):
        ModelSpec.from_dict({**d, "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 0})


def test_router_and_shared_gate_are_one_gemm_over_views_of_one_weight() -> None:
    """With a gated shared expert the router's and the gate's weights are rows of one tensor
    (loading either fills it) and the layer takes both logits from one GEMM; the grouped forward
    still equals the loop over experts, which calls the two modules apart."""
    moe = bound_moe(shared=40)
    both, router, gate = moe.router_and_gate, moe.gate, moe.shared_expert_gate
    assert both is not None and both.weight.shape == (17, 32) and both.shards("weight") == 0
    assert router.weight.data_ptr() == both.weight.data_ptr()
    assert gate.weight.data_ptr() == both.weight[16:].data_ptr()
    h = torch.randn(9, 32)
    w, ids, g = moe.route_and_gate(h)
    torch.testing.assert_close(g, gate(h), rtol=1e-6, atol=1e-6)
    w2, ids2 = moe.route(h)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=1e-6, atol=1e-6)
    assert bound_moe(shared=0).router_and_gate is None
