"""Qwen3.5 pieces against transformers (float32, tiny random sizes): the gated delta rule and
the causal convolution with states carried across calls, the Gated DeltaNet layer and the
gated attention layer on the same weights, whole-model log-probs of both families; and on
CUDA, fla-core's kernels against the torch path (DESIGN.md: the engine's results equal the
reference's; issue 17: Qwen3.5 teachers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import MATRIX, ROUTER, randomize_weights

from teacher_server.attention.registry import make_backend
from teacher_server.cache_layout import CacheLayout, LinearStateLayout
from teacher_server.kv_pool import KVPool
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.layers.runtime import Runtime
from teacher_server.models.gated_delta import GatedDeltaNet
from teacher_server.models.loader import load_model
from teacher_server.models.qwen3_5 import Qwen3_5Attention
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.gated_delta import (
    bounds_of,
    causal_conv1d,
    causal_conv1d_torch,
    check_fla,
    gated_delta_rule,
    gated_delta_rule_torch,
    linear_prep,
    make_plan,
)
from teacher_server.step_context import StepContext

tf = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35  # noqa: E402

CPU = torch.device("cpu")

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
            rms_norm_eps=1e-6)


# --- helpers -------------------------------------------------------------------------------
def rule_inputs(lens: list[int], h: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, dk, generator=g)
    k = torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(t, hv, generator=g)) * 0.5  # log decays <= 0
    beta = torch.rand(t, hv, generator=g)
    init = torch.randn(len(lens), hv, dk, dv, generator=g) * 0.5
    return q, k, v, decay, beta, init


def make_pool(spec: ModelSpec, slots: int) -> KVPool:
    """The engine's pool (Interface 1) with a few KV slots and ``slots`` state slots (slot 0
    the zero state), float32."""
    layout = LinearStateLayout(layers=spec.linear_layer_ids, conv_shape=(spec.linear_conv_dim, 4),
                               rec_shape=(4, 16, 8), conv_dtype=torch.float32)
    cache = CacheLayout.uniform(spec.kv_layer_ids, spec.num_kv_heads, spec.head_dim, torch.float32, layout)
    return KVPool(16, cache, CPU, state_slots=slots)


def step(lens: list[int], starts: list[int] | None = None, state_in: list[int] | None = None,
         keep: list[int] | None = None, out: list[int] | None = None, ids: torch.Tensor | None = None) -> StepContext:
    """A step of fresh chunks (lengths ``lens``; first positions ``starts``) with Interface 2's
    state fields."""
    starts = starts or [0] * len(lens)
    state_in = state_in or [0] * len(lens)
    cu = torch.tensor(bounds_of(lens), dtype=torch.int32)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    ctx = StepContext(input_ids=ids if ids is not None else torch.zeros(sum(lens), dtype=torch.int64),
                      positions=pos, cu_q=cu, cu_k=cu, max_q=max(lens), max_k=max(lens), q_lens=list(lens),
                      k_lens=list(lens), logits_idx=torch.arange(sum(lens)))
    ctx.state_in, ctx.state_in_host = torch.tensor(state_in), list(state_in)
    ctx.state_keep = torch.tensor(keep) if keep else None
    ctx.state_keep_host = list(keep) if keep else None
    ctx.state_out = torch.tensor(out) if keep else None
    ctx.linear_plan = None
    return ctx


def text_config(**kw) -> object:
    cfg = tf.Qwen3_5TextConfig(**{**TEXT, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def spec_of(cfg: object) -> ModelSpec:
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3_5ForCausalLM"]
    return ModelSpec.from_dict(d)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for every weight (zero-centred norms around 0, plain ones around 1,
    moderate decays)."""
    torch.manual_seed(seed)
    randomize_weights(model, (
        ("linear_attn.norm.weight", lambda n, p: 1.0 + 0.2 * torch.randn_like(p)),
        ("norm.weight", lambda n, p: 0.2 * torch.randn_like(p)),
        ("A_log", lambda n, p: torch.empty_like(p).uniform_(0.5, 4.0).log()),
        ("dt_bias", lambda n, p: 0.5 * torch.randn_like(p)),
        ("conv1d.weight", lambda n, p: 0.3 * torch.randn_like(p)),
        ROUTER,
        MATRIX,
    ))


def make_qwen3_5(path: Path, moe: bool = False, seed: int = 0, conditional: bool = False) -> Path:
    """A tiny random Qwen3.5 (or -MoE) checkpoint; ``conditional`` saves the weights under the
    vision-language names (``model.language_model.*``, plus tensors the loader must skip)."""
    from safetensors.torch import save_file

    if moe:
        cfg = tf.Qwen3_5MoeTextConfig(**{k: v for k, v in TEXT.items() if k != "intermediate_size"},
                                      moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                                      num_experts_per_tok=2)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    else:
        model = tf.Qwen3_5ForCausalLM(text_config())
    model = model.float().eval()
    randomize(model, seed)
    if not conditional:
        model.save_pretrained(path, safe_serialization=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    model.config.save_pretrained(path)
    tensors = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def group_scores_with_switch(path: Path, switch: str) -> tuple[dict[bool, list], list[int]]:
    """A GRPO-like group (one 48-token prompt, three 40-token continuations) scored through the
    public ``LLM`` on the CPU at a 32-token step budget (sequences in several chunks, the later
    ones from the prompt's cached snapshot) with ``FusedOps.<switch>`` off, then forced on: the
    scores of each, and the prefix-cache hits of each."""
    import numpy as np

    from teacher_server.llm import LLM

    out, hits = {}, []
    for on in (False, True):
        llm = LLM(str(path), device="cpu", max_model_len=256, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
        setattr(llm.engine.runner.ops, switch, on)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 256, 48).tolist()
        out[on] = [llm.score(prompt + rng.integers(0, 256, 40).tolist(), np.arange(256), start=50) for _ in range(3)]
        hits.append(llm.engine.stats().prefix_hit_tokens)
    return out, hits


def bind(module: torch.nn.Module, spec: ModelSpec, slots: int = 4) -> KVPool:
    pool = make_pool(spec, slots)
    rope = RotaryEmbedding(spec.rotary_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, 512, CPU)
    module.bind(Runtime(make_backend("sdpa", CPU, torch.float32), FusedOps(kernels=False, compile=False), pool,
                        {"default": rope}))
    return pool


# --- the ops -------------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [[130, 65, 5], [1], [64, 63]])
def test_rule_matches_transformers(lens: list[int]) -> None:
    """Each packed sequence (GVA, initial states, lengths across chunk ends) equals
    transformers' chunked and recurrent references on it alone, end states included."""
    q, k, v, g, beta, init = rule_inputs(lens)
    o, ends = gated_delta_rule_torch(q, k, v, g, beta, bounds_of(lens), init, True)
    b = bounds_of(lens)
    for n in range(len(lens)):
        sl = slice(b[n], b[n + 1])
        args = [x[sl][None] for x in (q, k, v, g, beta)]
        group = v.shape[-2] // k.shape[-2]  # q and k heads expanded to v's here (transformers before 5.21 does not)
        args[0], args[1] = (x.repeat_interleave(group, dim=2) for x in args[:2])
        for ref in (hf35.torch_chunk_gated_delta_rule, hf35.torch_recurrent_gated_delta_rule):
            ro, rs = ref(*args, initial_state=init[n:n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(o[sl], ro[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ends[n], rs[0], atol=1e-4, rtol=1e-4)


def test_rule_state_carried_across_calls() -> None:
    """Two calls (the first's end states as the second's initial states) equal one call, for
    every sequence of a packed step; without initial states the start is zero."""
    lens = [100, 37]
    q, k, v, g, beta, _ = rule_inputs(lens, seed=1)
    whole, ends = gated_delta_rule_torch(q, k, v, g, beta, bounds_of(lens), None, True)
    cut = [70, 10]  # the first part of each sequence
    b = bounds_of(lens)
    first = torch.cat([torch.arange(b[i], b[i] + cut[i]) for i in range(2)])
    second = torch.cat([torch.arange(b[i] + cut[i], b[i + 1]) for i in range(2)])
    part = lambda idx: [x[idx] for x in (q, k, v, g, beta)]  # noqa: E731
    o1, s1 = gated_delta_rule_torch(*part(first), bounds_of(cut), None, True)
    o2, s2 = gated_delta_rule_torch(*part(second), bounds_of([lens[i] - cut[i] for i in range(2)]), s1, True)
    torch.testing.assert_close(o1, whole[first], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o2, whole[second], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, ends, atol=1e-5, rtol=1e-5)


def test_rule_on_normed_inputs() -> None:
    """The layer's path: q, k normed by ``linear_prep`` (``qk_normed``) give the rule's result
    on the raw q, k."""
    lens = [90, 7]
    q, k, v, g, beta, init = rule_inputs(lens, seed=3)
    t, nk, dk = q.shape
    nv, dv = v.shape[1:]
    y = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
    raw_b, raw_a = torch.randn(t, nv), torch.randn(t, nv)
    qn, kn, vc, _, _ = linear_prep(y, raw_b, raw_a, torch.zeros(nv), torch.zeros(nv), nk, dk, nv, dv)
    want = gated_delta_rule_torch(q, k, v, g, beta, bounds_of(lens), init, True)
    got = gated_delta_rule_torch(qn, kn, vc, g, beta, bounds_of(lens), init, True, qk_normed=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plan = make_plan(lens, torch.tensor(bounds_of(lens)), True, True)  # the dispatcher passes the flag on
    for a, b in zip(gated_delta_rule(qn, kn, vc, g, beta, plan, init, True, qk_normed=True), want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gated_delta_rule_torch(q, k, v, g, beta, bounds_of(lens), init, True,
                                                     qk_normed=True)[0], want[0], atol=1e-2)  # the flag is read


def test_conv_matches_transformers_and_carries_state() -> None:
    """The convolution + SiLU equals transformers' without a state; split into parts with the
    end states carried it equals the whole, short parts (fewer tokens than the kernel) included."""
    gen = torch.Generator().manual_seed(2)
    d, w = 12, 4
    x = torch.randn(40, d, generator=gen)
    weight = torch.randn(d, w, generator=gen)
    whole, end = causal_conv1d_torch(x, weight, [0, 40], None, True)
    ref = hf35.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end[0], x[-w:].t())
    state, outs = None, []
    for a, b in [(0, 2), (2, 3), (3, 20), (20, 40)]:
        y, state = causal_conv1d_torch(x[a:b], weight, [0, b - a], state, True)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, end)
    # packed: two sequences in one call, one of them from a stored state
    y2, ends2 = causal_conv1d_torch(torch.cat([x[20:40], x[:5]]), weight, [0, 20, 25],
                                    torch.stack([outs_state(x, 20, w), torch.zeros(d, w)]), True)
    torch.testing.assert_close(y2[:20], whole[20:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y2[20:], whole[:5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ends2[0], end[0])


def outs_state(x: torch.Tensor, p: int, w: int) -> torch.Tensor:
    """The convolution state at position p: the last w inputs before it, [D, W] (zeros before 0)."""
    prev = torch.cat([torch.zeros(w, x.shape[1]), x[:p]])[-w:]
    return prev.t()


# --- the layers ----------------------------------------------------------------------------
def our_delta_net(hf: torch.nn.Module, spec: ModelSpec, layer: int) -> GatedDeltaNet:
    ours = GatedDeltaNet(spec, layer, torch.float32, CPU)
    for part in ("qkv", "z", "b", "a"):
        ours.in_proj.load_weight("weight", getattr(hf, f"in_proj_{part}").weight, part, part)
    for ours_name, theirs in (("conv_weight", hf.conv1d.weight), ("A_log", hf.A_log), ("dt_bias", hf.dt_bias)):
        ours.load_weight(ours_name, theirs.detach(), None, ours_name)
    ours.norm.load_weight("weight", hf.norm.weight, None, "norm")
    ours.o_proj.load_weight("weight", hf.out_proj.weight, None, "out_proj")
    return ours


@torch.no_grad()
def test_delta_net_layer_matches_transformers() -> None:
    """The layer (with o_proj) equals Qwen3_5GatedDeltaNet on the same weights; run as two
    chunks with the state carried through the pool (in place), and packed beside another
    sequence, it gives the same rows."""
    cfg = text_config()
    hf = hf35.Qwen3_5GatedDeltaNet(cfg, 0).float().eval()
    randomize(hf, 3)
    spec = spec_of(cfg)
    ours = our_delta_net(hf, spec, 0)
    pool = bind(ours, spec)
    x = torch.randn(90, spec.hidden_size, generator=torch.Generator().manual_seed(4))
    ref = hf(x[None])[0]
    full = ours.o_proj(ours(x, None, step([90])))
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    # two chunks: 70 then 20 tokens, the state carried in slot 2
    a = ours.o_proj(ours(x[:70], None, step([70], keep=[0], out=[2])))
    b = ours.o_proj(ours(x[70:], None, step([20], starts=[70], state_in=[2], keep=[0], out=[2])))
    torch.testing.assert_close(torch.cat([a, b]), ref, atol=1e-4, rtol=1e-4)
    # packed: the continuation from a snapshot of the state at 70 beside a fresh sequence
    ours(x[:70], None, step([70], keep=[0], out=[1]))
    y = ours.o_proj(ours(torch.cat([x[70:], x[:15]]), None, step([20, 15], starts=[70, 0], state_in=[1, 0])))
    torch.testing.assert_close(y[:20], ref[70:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y[20:], ref[:15], atol=1e-4, rtol=1e-4)
    assert pool.conv_state(0)[0].abs().max() == 0 and pool.rec_state(0)[0].abs().max() == 0  # slot 0 untouched


@torch.no_grad()
def test_gated_attention_matches_transformers() -> None:
    """The gated attention layer (q/k norms (1 + w), partial rotary, sigmoid output gate, with
    o_proj) equals Qwen3_5Attention on the same weights, for two packed sequences."""
    cfg = text_config()
    hf = hf35.Qwen3_5Attention(cfg, 3).float().eval()
    randomize(hf, 5)
    spec = spec_of(cfg)
    ours = Qwen3_5Attention(spec, 3, torch.float32, CPU)
    for part in ("q", "k", "v"):
        ours.qkv_proj.load_weight("weight", getattr(hf, f"{part}_proj").weight, part, part)
    ours.q_norm.load_weight("weight", hf.q_norm.weight, None, "q_norm")
    ours.k_norm.load_weight("weight", hf.k_norm.weight, None, "k_norm")
    ours.o_proj.load_weight("weight", hf.o_proj.weight, None, "o_proj")
    bind(ours, spec)
    rope = hf35.Qwen3_5TextRotaryEmbedding(cfg)
    x = torch.randn(50, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    lens = [30, 20]
    refs = []
    for a, n in ((0, 30), (30, 20)):
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        refs.append(hf(x[None, a:a + n], rope(x[None, a:a + n], pos), mask)[0][0])
    ctx = step(lens)
    got = ours.o_proj(ours(x, ours.rt.ropes["default"](ctx.positions), ctx))
    torch.testing.assert_close(got, torch.cat(refs), atol=1e-5, rtol=1e-5)


# --- whole models --------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("kind", ["dense", "moe", "dense_conditional", "moe_conditional"])
def test_model_logprobs_match_transformers(kind: str, tmp_path: Path) -> None:
    """Both families, both checkpoint kinds: the final hidden rows through the LM head give
    transformers' float32 log-probs within 1e-4, for two sequences packed in one step."""
    moe = kind.startswith("moe")
    plain = make_qwen3_5(tmp_path / "plain", moe=moe, seed=7)
    path = make_qwen3_5(tmp_path / kind, moe=moe, seed=7, conditional=True) if kind.endswith("conditional") else plain
    spec = ModelSpec.from_dir(path)
    model = load_model(path, spec, torch.float32, CPU)
    bind(model, spec)
    hf = (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM).from_pretrained(
        plain, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in (80, 33)]
    ref = torch.cat([torch.log_softmax(hf(s[None]).logits[0].double(), -1) for s in seqs])
    for residual_in_gemm in (False, True):  # the CPU default, then the CUDA one
        model.rt.ops.residual_in_gemm = residual_in_gemm
        ctx = step([80, 33], ids=torch.cat(seqs))
        lp = torch.log_softmax((model(ctx) @ model.lm_head.t()).double(), -1)
        assert (lp - ref).abs().max().item() < 1e-4


def test_layout_and_checkpoint_names(tmp_path: Path) -> None:
    """The state each slot holds per linear layer, and the names of both checkpoint kinds."""
    path = make_qwen3_5(tmp_path / "c", conditional=True)
    spec = ModelSpec.from_dir(path)
    model = load_model(path, spec, torch.float32, CPU)
    layout = model.linear_state_layout()
    assert layout.layers == (0, 1, 2)
    assert layout.conv_shape == (spec.linear_conv_dim, 4) and layout.rec_shape == (4, 16, 8)
    assert model.checkpoint_param("model.visual.blocks.0.attn.qkv.weight") is None
    assert model.checkpoint_param("mtp.layers.0.mlp.gate_proj.weight") is None
    assert model.checkpoint_param("model.language_model.layers.1.linear_attn.in_proj_b.weight") == (
        "layers.1.linear_attn.in_proj", "weight", "b")
    assert model.checkpoint_param("model.layers.0.linear_attn.conv1d.weight") == (
        "layers.0.linear_attn", "conv_weight", None)


# --- fla-core on CUDA ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_path_matches_torch_path(dtype: torch.dtype) -> None:
    """fla-core's convolution and chunked rule (varlen, initial and end states) against the
    torch path on the same inputs."""
    from teacher_server.ops.gated_delta import fla_ops

    assert fla_ops() is not None, "fla-core is not importable on this CUDA machine"
    dev = torch.device("cuda")
    lens = [300, 130, 64, 5, 1]
    q, k, v, g, beta, init = (x.to(dev) for x in rule_inputs(lens, h=4, hv=8, dk=128, dv=128, seed=9))
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    cu = torch.tensor(bounds_of(lens), device=dev)
    plan = make_plan(lens, cu, True, True)
    assert plan.fla is not None
    o, ends = gated_delta_rule(q, k, v, g, beta, plan, init, True)
    ro, rends = gated_delta_rule_torch(q, k, v, g, beta, plan.bounds, init, True)
    # relative error over the whole tensor: bf16 inputs, and float32 ones through TF32 dots
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(o, ro) < tol and rel(ends, rends) < tol, (rel(o, ro), rel(ends, rends))
    gen = torch.Generator(device=dev).manual_seed(10)
    wide = torch.randn(sum(lens), 200, device=dev, generator=gen).to(dtype)
    x = wide[:, :96]  # a column slice, as the layer passes it
    weight = torch.randn(96, 4, device=dev, generator=gen).to(dtype)
    conv_init = torch.randn(len(lens), 96, 4, device=dev, generator=gen).to(dtype)
    y, cend = causal_conv1d(x, weight, plan, conv_init, True)
    ry, rcend = causal_conv1d_torch(x, weight, plan.bounds, conv_init, True)
    assert rel(y, ry) < tol, rel(y, ry)
    torch.testing.assert_close(cend, rcend, atol=0, rtol=0)  # copies of the inputs
    if dtype != torch.bfloat16:
        # The serving dtype's layer path follows. In float32 each new kernel variant costs
        # fla-core minutes of autotuning on a fresh machine; the float32 layer path (compiled
        # input stage, normed q and k, start-up check) is covered end to end by
        # test_qwen3_5_gpu.py's float32 parity test.
        return
    # the layer's path: q, k normed (and q, k, v made contiguous) by the compiled input stage
    t, nk, dk = q.shape
    nv, dv = v.shape[1:]
    y = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
    pgen = torch.Generator(device=dev).manual_seed(11)
    ba = torch.randn(t, 2 * nv + 1, device=dev, generator=pgen).to(dtype)  # b and a strided, as the layer's
    a_log, dt_bias = torch.randn(nv, device=dev, generator=pgen).to(dtype), torch.zeros(nv, device=dev, dtype=dtype)
    args = (y, ba[:, 1:1 + nv], ba[:, 1 + nv:], a_log, dt_bias, nk, dk, nv, dv)
    ops = FusedOps(kernels=False, compile=True)
    got = ops.linear_prep(*args)
    assert ops.compiled and ops.linear_prep.ok, "the compiled stage fell back to eager"
    assert all(x.is_contiguous() for x in got[:3])
    for a, b in zip(got, linear_prep(*args), strict=True):  # the compiled stage against its eager definition
        assert rel(a, b) < 1e-2, rel(a, b)
    qn, kn, vc = got[:3]
    on, oends = gated_delta_rule(qn, kn, vc, g, beta, plan, init, True, qk_normed=True)
    assert rel(on, o) < tol / 4 and rel(oends, ends) < tol / 4, (rel(on, o), rel(oends, ends))
    assert check_fla(4, 8, 128, 128, 1024, 4, dev, dtype)  # the start-up check passes at a real shape


def test_warm_up_switches_off_the_fused_qkv_kernel(tmp_path: Path) -> None:
    """The start-up checks run at the model's shapes; the fused QKV kernel (whole-head rotary,
    no output gate) is switched off, the other kernels stay on."""
    path = make_qwen3_5(tmp_path / "m")
    spec = ModelSpec.from_dir(path)
    model = load_model(path, spec, torch.float32, CPU)
    ops = FusedOps(kernels=True, compile=False, kernels_available=lambda: True)
    model.warm_up_ops(ops, model.make_ropes(64, CPU))
    assert not ops.qkv_kernel and ops.silu_kernel and ops.residual_in_gemm
    assert not ops.conv_kernel  # the fused input stage is a CUDA kernel: off on the CPU
    # the gated norm is checked as the layers call it: z's columns in the in-projection's output
    mixer = model.layers[spec.linear_layer_ids[0]].linear_attn
    width = mixer.in_proj.weight.shape[0]
    assert ops.gated_norm_shape == (spec.linear_num_value_heads, spec.linear_value_head_dim, width, mixer.conv_dim)


def test_tensor_parallel_must_split_the_linear_key_heads(tmp_path: Path) -> None:
    """A tensor-parallel size that does not divide the linear layers' key heads is a clear
    start-up error (the heads are split whole across ranks)."""
    from teacher_server.config import Config
    from teacher_server.engine.engine import Engine

    path = make_qwen3_5(tmp_path / "m")
    spec = ModelSpec.from_dir(path)
    size = next(n for n in range(2, 9) if spec.num_heads % n == 0 and spec.linear_num_key_heads % n)
    with pytest.raises(ValueError, match="linear-attention key heads"):
        Engine(Config(model=str(path), device="cpu", tensor_parallel_size=size))


# --- end to end ------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("moe", [False, True])
def test_llm_scores_match_transformers_chunked_and_cached(moe: bool, tmp_path: Path) -> None:
    """Through the public ``LLM``: a GRPO-like group (one prompt, three responses) scored one
    after another at a 32-token step budget (every sequence in several chunks, its state
    carried; the later ones start from the prompt's cached snapshot) gives transformers'
    float32 log-probs within 1e-4, and the cache was hit."""
    import numpy as np

    from teacher_server.llm import LLM

    path = make_qwen3_5(tmp_path / "m", moe=moe, seed=3)
    hf = (tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(str(path), device="cpu", max_model_len=256, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 48).tolist()
    start = 50  # the first scored row, after the prompt
    for _ in range(3):
        ids = prompt + rng.integers(0, 256, 40).tolist()
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()[start:len(ids) - 1]
        got = llm.score(ids, np.arange(256), start=start)
        assert np.abs(got - ref).max() < 1e-4
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens > 0 and stats.state_snapshots >= 1
