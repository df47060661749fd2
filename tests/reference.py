"""Tiny random checkpoints of every supported family (written with transformers'
save_pretrained) and the float32 transformers reference the engine is checked against."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

FAMILIES = ("llama", "llama3rope", "qwen2", "qwen3", "mistral", "qwen3tied", "qwen2yarn")
# Mixture-of-experts families (make_moe_checkpoint); "qwen3moe_stacked" is saved in the stacked
# [E, ...] expert layout, the others as save_pretrained writes them (one tensor per expert).
MOE_FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "qwen3moe_stacked")
# Hybrid families (make_hybrid_checkpoint): Qwen3.5 dense, MoE, and the vision-language
# checkpoint of the dense one (its text part is scored); "_hd128" are the GPU-sized variants.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl")



# A draw for one parameter: (its name, the parameter) -> new values.
Draw = Callable[[str, torch.Tensor], torch.Tensor]
ROUTER: tuple[str, Draw] = ("mlp.gate.weight", lambda n, p: torch.randn_like(p))  # far from top-k boundaries
MATRIX: tuple[str, Draw] = ("", lambda n, p: torch.randn_like(p) * (0.5 if "embed" in n else 0.1))


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, rules: tuple[tuple[str, Draw], ...] = ()) -> None:
    """Non-trivial values for every weight, drawn in parameter order from torch's global
    generator (seed it first), so every weight matters: the first of ``rules`` whose name
    suffix matches, else norms 1 + 0.2 N(0, 1), biases 0.1 N(0, 1), matrices N(0, 1) x 0.5
    (embeddings) or x 0.1; other parameters are left as they are."""
    for name, p in model.named_parameters():
        draw = next((f for suffix, f in rules if name.endswith(suffix)), None)
        if draw is not None:
            p.copy_(draw(name, p))
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))
        elif p.dim() >= 2:
            p.copy_(MATRIX[1](name, p))


def make_checkpoint(family: str, path: Path, seed: int = 0, max_pos: int = 4096) -> Path:
    """Save a tiny random model of ``family`` to ``path`` (float32 safetensors)."""
    import transformers as tf

    if family.split(":")[0] in MOE_FAMILIES:
        return make_moe_checkpoint(family, path, seed)
    if family.startswith("qwen3_5"):
        return make_hybrid_checkpoint(family, path, seed)

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif family == "llama3rope":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen2yarn":
        cfg = tf.Qwen2Config(**common, rope_theta=10000.0,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3hd128":  # the real head dim: the fused CUDA kernels and cuDNN paths take it
        cfg = tf.Qwen3Config(**{**common, "hidden_size": 256, "intermediate_size": 512}, head_dim=128,
                             rope_theta=1000000.0)
        cls = tf.Qwen3ForCausalLM
    elif family in ("qwen3", "qwen3tied"):
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=family == "qwen3tied")
        cls = tf.Qwen3ForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif family == "qwen2mixed":  # layer 0 global, the others sliding (max_window_layers)
        cfg = tf.Qwen2Config(**{**common, "num_hidden_layers": 4}, rope_theta=10000.0, use_sliding_window=True,
                             sliding_window=12, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif family in ("qwen3mixed", "qwen3mixed_hd128"):  # global, sliding, global, sliding (layer_types)
        big = family.endswith("hd128")  # the GPU-sized variant: head dim 128, a window past cuDNN's minimum
        dims = {"hidden_size": 256, "intermediate_size": 512} if big else {}
        cfg = tf.Qwen3Config(**{**common, **dims, "num_hidden_layers": 4}, head_dim=128 if big else 32,
                             rope_theta=1000000.0, use_sliding_window=True, sliding_window=300 if big else 12,
                             layer_types=["full_attention", "sliding_attention"] * 2)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_moe_checkpoint(family: str, path: Path, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                        clear_on: list[np.ndarray] | None = None, min_gap: float = 1e-3) -> Path:
    """A tiny random MoE of ``family`` ("name" or "name:vocab"); dense layers are mixed in where
    the family has them. The router weights are large (std 1 logits per unit input).

    Large weights alone do not keep float32 rounding from flipping a top-k choice: the rounding
    of a logit grows with the logit. Tests that compare two float paths (TP or PP against one
    process) at 1e-5 pass ``clear_on``, the token sequences they score: the first seed from
    ``seed`` on whose routers keep every one of those tokens' k-th and (k+1)-th logits at least
    ``min_gap`` apart is used (rounding moves them by ~1e-5 here), so no choice sits on a tie."""
    import transformers as tf
    from safetensors.torch import save_file

    name, _, vocab = family.partition(":")
    common = dict(vocab_size=int(vocab or 512), hidden_size=64, num_hidden_layers=3, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=8192, rms_norm_eps=1e-6)
    if name in ("qwen3moe", "qwen3moe_stacked"):
        cfg = tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1])
        cls = tf.Qwen3MoeForCausalLM
    elif name == "qwen2moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=48,
                                decoder_sparse_step=2)  # layers 1 routed, 0 and 2 dense
        cls = tf.Qwen2MoeForCausalLM
    elif name == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                               sliding_window=None)
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(family)
    for attempt in range(seed, seed + 50):
        torch.manual_seed(attempt)
        model = cls(cfg).to(torch.float32).eval()
        randomize_weights(model, (ROUTER,))
        if clear_on is None or router_gap(model, clear_on, cfg.num_experts_per_tok) >= min_gap:
            break
    else:
        raise RuntimeError(f"no seed in [{seed}, {seed + 50}) keeps {family}'s routers {min_gap} clear of a tie")
    if name.endswith("_stacked"):
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    else:
        model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def router_gap(model: torch.nn.Module, sequences: list[np.ndarray], k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th router logit over every token of
    ``sequences`` and every routed layer of ``model`` (a transformers MoE), in float64 from
    the routers' inputs."""
    inputs: list[torch.Tensor] = []
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate") and getattr(m, "weight", None) is not None]
    if not gates:
        raise ValueError(f"no router (a module named *mlp.gate with a weight) in {type(model).__name__}")
    hooks = [g.register_forward_pre_hook(lambda mod, args: inputs.append((mod.weight, args[0]))) for g in gates]
    try:
        for seq in sequences:
            model(input_ids=torch.as_tensor(np.asarray(seq), dtype=torch.long)[None])
    finally:
        for h in hooks:
            h.remove()
    gap = float("inf")
    for weight, x in inputs:
        logits = x.reshape(-1, x.shape[-1]).double() @ weight.double().T
        top = logits.topk(k + 1, dim=-1).values
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    return gap


def make_hybrid_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 of ``family`` (HYBRID_FAMILIES, or "..._hd128" for the GPU-sized
    head dims): Gated DeltaNet layers and gated full-attention layers mixed, more value than
    key heads in the linear layers (grouped value attention), partial rotary.

    The linear layers' decay ``exp(-exp(A_log) * softplus(a + dt_bias))`` is kept near 1
    (A in [0.005, 0.1]; transformers draws up to 16, which forgets everything after a token),
    and the convolution weights are large, so the state carried across chunk boundaries and
    prefix hits shapes every later row: a state that is lost or misplaced shows in the scores.
    "qwen3_5_vl" is a ``Qwen3_5ForConditionalGeneration`` (a tiny vision tower, whose weights
    the server skips, and one ``mtp.*`` tensor as the released checkpoints carry)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    base = family.removesuffix("_hd128")
    big = family.endswith("_hd128")
    full, lin = "full_attention", "linear_attention"
    common = dict(vocab_size=512, hidden_size=256 if big else 64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128 if big else 16, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=128 if big else 16, linear_value_head_dim=128 if big else 8)
    if base in ("qwen3_5", "qwen3_5_vl"):  # full attention every 2nd layer, rotary on a quarter of the head
        cfg = tf.Qwen3_5TextConfig(**common, intermediate_size=512 if big else 128, num_hidden_layers=4,
                                   layer_types=[lin, full, lin, full],
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25})
        cls = tf.Qwen3_5ForCausalLM
    elif base == "qwen3_5_moe":  # every 4th layer full (the released pattern), rotary on half the head
        cfg = tf.Qwen3_5MoeTextConfig(**common, num_hidden_layers=4, layer_types=[lin, lin, lin, full],
                                      moe_intermediate_size=64 if big else 32, shared_expert_intermediate_size=48,
                                      num_experts=8, num_experts_per_tok=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                       "partial_rotary_factor": 0.5})
        cls = tf.Qwen3_5MoeForCausalLM
    else:
        raise ValueError(family)
    if base == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, temporal_patch_size=1,
                      spatial_merge_size=1, out_hidden_size=cfg.hidden_size, num_position_embeddings=16)
        cfg = tf.Qwen3_5Config(text_config=cfg.to_dict(), vision_config=vision)
        cls = tf.Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    randomize_weights(model, (
        ("A_log", lambda n, p: torch.empty_like(p).uniform_(0.005, 0.1).log()),
        ("dt_bias", lambda n, p: 0.5 * torch.randn_like(p)),
        ("conv1d.weight", lambda n, p: 0.5 * torch.randn_like(p)),
        ("linear_attn.norm.weight", lambda n, p: 1.0 + 0.2 * torch.randn_like(p)),  # the gated norm: weight
        ("norm.weight", lambda n, p: 0.2 * torch.randn_like(p)),  # the decoder norms scale by (1 + weight)
        ROUTER,
    ))
    model.save_pretrained(path, safe_serialization=True)
    if base == "qwen3_5_vl":  # the multi-token-prediction head of released checkpoints (skipped by both)
        tensors = load_file(str(path / "model.safetensors"))
        tensors["mtp.fc.weight"] = torch.randn(cfg.text_config.hidden_size, 2 * cfg.text_config.hidden_size)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    key = f"{path}:{dtype}"
    if key not in _MODELS:
        import transformers as tf

        _MODELS[key] = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return _MODELS[key]


# transformers binds the Gated DeltaNet functions of its Qwen3.5 modules to fla-core's GPU kernels
# when fla-core is importable (decided at import); the float32 CPU reference needs the plain
# torch functions they wrap.
_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")


@contextlib.contextmanager
def torch_reference_kernels() -> Iterator[None]:
    """Within: transformers' Qwen3.5 modules call their torch functions, not fla-core's."""
    saved = []
    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        module = sys.modules.get(f"transformers.models.{name}.modeling_{name}")
        for func in _KERNEL_FUNCS if module is not None else ():
            f = getattr(module, func, None)
            plain = getattr(f, "__wrapped__", None)
            if plain is not None:
                saved.append((module, func, f))
                setattr(module, func, plain)
    try:
        yield
    finally:
        for module, func, f in saved:
            setattr(module, func, f)


@torch.no_grad()
def reference_logprobs(path: Path, token_ids: list[int]) -> np.ndarray:
    """[L, V] float64 log-probs of the float32 transformers forward; row p predicts token p+1."""
    model = hf_model(path)
    with torch_reference_kernels():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def reference_scores(path: Path, token_ids: list[int], cand, start: int, logits_mode: bool = False) -> np.ndarray:
    """The [rows, K] matrix the contract defines, from the transformers reference."""
    n = len(token_ids)
    rows = max(n - 1 - start, 0)
    cand = np.asarray(cand)
    k = cand.shape[-1]
    if rows == 0:
        return np.zeros((0, k), dtype=np.float32)
    if logits_mode:
        model = hf_model(path)
        with torch.no_grad(), torch_reference_kernels():
            lp = model(torch.tensor([token_ids])).logits[0].double().numpy()
    else:
        lp = reference_logprobs(path, token_ids)
    out = np.empty((rows, k), dtype=np.float64)
    for i in range(rows):
        c = cand[i] if cand.ndim == 2 else cand
        row = lp[start + i]
        out[i] = np.where(c >= 0, row[np.clip(c, 0, None)], -np.inf)
    return out.astype(np.float32)


def gpu_rows(model: torch.nn.Module, token_ids: np.ndarray, cand: np.ndarray, start: int) -> np.ndarray:
    """The [rows, K] matrix of a transformers model's forward on its device (its logits'
    log-softmax in float32), -inf where a candidate is -1."""
    with torch.no_grad():
        lg = model(torch.tensor([token_ids.tolist()], device=next(model.parameters()).device)).logits[0]
    lp = torch.log_softmax(lg.float(), -1).cpu().double().numpy()
    rows = len(token_ids) - 1 - start
    return np.stack([np.where((c := (cand[i] if cand.ndim == 2 else cand)) >= 0, lp[start + i][np.clip(c, 0, None)],
                              -np.inf) for i in range(rows)])


def errors_vs_reference(path: Path, reqs: list, results: list,
                        model: torch.nn.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per request with rows: the abs errors of our scores and of ``model``'s forward (on the
    GPU in the tests that use it) against the float32 reference, over its finite cells
    (results must be error-free)."""
    ours, theirs = [], []
    for q, r in zip(reqs, results):
        assert r.error is None, r.error
        if q.rows == 0:
            continue
        ref = reference_scores(path, q.token_ids.tolist(), q.candidates, q.start)
        fin = np.isfinite(ref)
        ours.append(np.abs(r.token_id_logprobs[fin] - ref[fin]))
        theirs.append(np.abs(gpu_rows(model, q.token_ids, np.asarray(q.candidates), q.start)[fin] - ref[fin]))
    return ours, theirs
