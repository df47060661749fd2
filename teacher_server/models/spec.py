"""ModelSpec: the architecture facts read from an HF ``config.json``, validated.

Parsed by hand (no ``transformers`` at run time). Handles both the classic layout
(``rope_theta`` + ``rope_scaling``) and the newer one (``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from teacher_server.layers.deepseek_moe import ExpertRouting
from teacher_server.layers.formats import format_name
from teacher_server.models.deepseek_spec import MlaDims, deepseek_facts
from teacher_server.models.gemma3_spec import GemmaDims, gemma3_config, gemma3_facts
from teacher_server.models.glm4_moe_spec import glm4_moe_facts
from teacher_server.models.gpt_oss_spec import gpt_oss_facts
from teacher_server.models.hybrid_spec import hybrid_facts
from teacher_server.models.registry import ARCHITECTURES
from teacher_server.models.rope_config import rope_facts
from teacher_server.unsupported import UnsupportedModelError


@dataclass(frozen=True)
class ModelSpec:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool | None = None  # None: decided by the presence of lm_head.weight
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str | None = None
    # Mixture of experts (num_experts == 0: a dense model). Layer i routes through experts
    # when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, as transformers
    # decides; other layers are dense with intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # of each routed expert
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, sigmoid-gated)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Per-layer kinds: layer_types[i] is "full_attention", "sliding_attention" (attention
    # over the last sliding_window keys: Qwen2/Qwen3 with use_sliding_window) or, in hybrid
    # families (Qwen3.5), "linear_attention" (Gated DeltaNet: a short causal convolution and
    # a recurrent state per sequence, no KV). Empty: every layer is attention with the
    # model's one window (sliding_window, or None).
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims of q and k
    attn_output_gate: bool = False  # q_proj also makes a per-head gate: out * sigmoid(gate)
    zero_centered_norm: bool = False  # RMSNorm scales by (1 + weight)
    # How the weights are stored: a format of ``layers.formats`` (config.json's quantization_config)
    weight_format: str = "unquantized"
    quantization_config: dict[str, Any] = field(default_factory=dict)
    fp8_fast_accum: bool = True  # FP8 row-wise products in Hopper's fast accumulation (``Config.fp8_fast_accum``)
    # DeepSeek-V2/V3 (``deepseek_spec``): latent attention (head_dim is then q/k's width) and
    # the expert routing rules; None in the other families.
    mla: MlaDims | None = None
    routing: ExpertRouting | None = None
    mtp_layers: int = 0  # (and GLM-4.5) multi-token-prediction layers after the last: not for scoring
    # gpt-oss (``gpt_oss_spec``): a learned sink logit per attention head, and the experts'
    # clamped SwiGLU (``layers.gpt_oss_moe``); off in the other families.
    attention_sinks: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Gemma 3 (``gemma3_spec``): the local layers' rotary base, the softmax scale, the logit cap.
    gemma: GemmaDims | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:  # the rope part of each q/k head
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer``'s attention (None: full attention). With
        ``layer_types`` only its ``sliding_attention`` layers slide (Qwen2/Qwen3 with use_sliding_window:
        the layers from max_window_layers on); without, every layer takes ``sliding_window`` (Mistral, Mixtral)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a Gated DeltaNet (linear attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """Decoder layers with paged KV (every layer of a non-hybrid family)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """Decoder layers with a recurrent state per sequence instead of KV."""
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v of the linear layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes through experts (else its MLP is dense)."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers and not (layer + 1) % self.decoder_sparse_step

    def non_embedding_params(self) -> int:
        """Parameters touched per token, excluding the embedding and LM head (for FLOP counts).
        In an expert layer that is the router, the top-k routed experts and the shared expert
        (the active parameters), not all experts."""
        h, i = self.hidden_size, self.intermediate_size
        q_out = self.q_size * (2 if self.attn_output_gate else 1)
        attn = h * (q_out + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:  # q (low-rank or not), the latent, its up-projection, o
            m, n = self.mla, self.num_heads
            q = h * m.q_lora_rank + m.q_lora_rank * self.q_size if m.q_lora_rank else h * self.q_size
            attn = q + h * m.latent + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim * h
        # A linear layer: in-projections (q, k, v, the output gate z, b and a), the depthwise
        # convolution and the out-projection.
        nv = self.linear_num_value_heads
        linear = (h * (self.linear_conv_dim + self.linear_value_dim + 2 * nv)
                  + self.linear_conv_dim * self.linear_conv_kernel_dim + self.linear_value_dim * h)
        total = 0
        for layer in range(self.num_layers):
            if self.is_moe_layer(layer):
                si = self.shared_expert_intermediate_size  # the shared expert and its sigmoid gate
                shared = 3 * h * si + (h if si and not self.routing else 0)
                mlp = h * self.num_experts + 3 * h * self.moe_intermediate_size * self.num_experts_per_tok + shared
            else:
                mlp = 3 * h * i
            total += (linear if self.is_linear_layer(layer) else attn) + mlp
        return total

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        archs = d.get("architectures") or []
        top = d
        if isinstance(d.get("text_config"), dict):  # a vision-language checkpoint: its text model
            # (transformers' ...ForConditionalGeneration ties the head as the top level says)
            d = {**d["text_config"], "architectures": archs,
                 "tie_word_embeddings": d.get("tie_word_embeddings"),
                 "model_type": d["text_config"].get("model_type", d.get("model_type"))}
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None and not archs:  # a config naming no architecture: its model_type's causal LM
            model_type = d.get("model_type")
            by_type = {v.family: k for k, v in ARCHITECTURES.items()}
            arch = by_type.get(model_type.removesuffix("_text")) if model_type else None
        if arch is None:
            # a known model_type does not make another head (a classifier, a reward model) a causal LM's
            heads = [a for a in archs if a.endswith(("Model", "Classification", "Answering")) and "LMHead" not in a]
            raise UnsupportedModelError(f"unsupported architecture {archs or d.get('model_type')!r}" + (
                f" ({', '.join(heads)} has no language-model head to score with)" if heads else "")
                + "; supported: " + ", ".join(ARCHITECTURES))
        entry = ARCHITECTURES[arch]
        family = entry.family
        seen = top if top is d else {**top, **d}
        refuse_unbuilt(arch, entry.attention_bias, seen, gelu=entry.gemma3)
        weight_format = format_name(seen.get("quantization_config"))
        if weight_format == "mxfp4" and not entry.gpt_oss:  # only gpt-oss's expert layout is read packed
            raise UnsupportedModelError(f"{arch} with MXFP4 weights is not supported (gpt-oss's experts are)")
        d = entry.with_defaults(d)  # a key left out: transformers' default for the family
        if entry.gemma3:  # its per-layer-kind rope_parameters as the hub's keys
            d = gemma3_config(d)
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        if entry.deepseek:  # q/k's width (transformers' head_dim there is the rope part)
            head_dim = int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"])
        rope_params, theta, merged = rope_facts(d)
        sliding, layer_types = None, ()
        if entry.sliding_window:
            sliding = d.get("sliding_window")
        elif entry.layer_sliding:
            sliding, layer_types = layer_sliding_facts(d, int(d["num_hidden_layers"]))
        elif entry.refuse_sliding_window and d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{arch} sliding-window attention (use_sliding_window=true) is not supported")
        return cls(
            family=family,
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense layers and no intermediate_size.
            intermediate_size=int(d.get("intermediate_size") or d.get("moe_intermediate_size") or 0),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=merged,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=d.get("tie_word_embeddings"),
            attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", entry.attention_bias))),
            qk_norm=entry.qk_norm or bool(d.get("use_qk_norm")),  # (GLM-4.5's switch)
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            **({"layer_types": layer_types} if layer_types else {}),
            weight_format=weight_format,
            quantization_config=dict(seen.get("quantization_config") or {}),
            **(moe_facts(d, entry.always_norm_topk, entry.sparse_step) if entry.moe else {}),
            **(hybrid_facts(d, int(d["num_hidden_layers"]), rope_params) if entry.hybrid else {}),
            **(deepseek_facts(arch, d) if entry.deepseek else {}),
            **(gpt_oss_facts(d, int(d["num_hidden_layers"])) if entry.gpt_oss else {}),
            **(gemma3_facts(d) if entry.gemma3 else {}),
            **(glm4_moe_facts(d, rope_params) if entry.glm4_moe else {}),
        )

    def with_quantization(self, quantization: str | None, fp8_fast_accum: bool | None = None) -> ModelSpec:
        """This spec served with ``--quantization`` (None: as it is): ``fp8`` quantizes a bf16
        checkpoint's projections and experts at load (``fp8_online``); a checkpoint quantized
        already is refused. ``fp8_fast_accum``: ``Config.fp8_fast_accum`` (None: as it is)."""
        spec = self if fp8_fast_accum in (None, self.fp8_fast_accum) else replace(self, fp8_fast_accum=fp8_fast_accum)
        if quantization is None:
            return spec
        if quantization != "fp8":
            raise UnsupportedModelError(f"--quantization {quantization!r}: only fp8 is built")
        if self.weight_format != "unquantized":
            raise UnsupportedModelError(f"--quantization fp8 quantizes a bf16 checkpoint at load; this one is "
                                        f"quantized already (quant_method {self.weight_format!r}): serve it "
                                        f"without --quantization")
        return replace(spec, weight_format="fp8_online", quantization_config={"quant_method": "fp8_online"})

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            d = json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{cfg} is not a JSON object")
        return cls.from_dict(d)


def refuse_unbuilt(arch: str, qkv_bias: bool, d: dict[str, Any], gelu: bool = False) -> None:
    """What changes the math and is not built: refused by name rather than scored differently
    (an activation) or failing on a checkpoint tensor with "no place" (biases; weight formats
    are refused by ``layers.formats.format_name``). ``d`` holds a vision-language config's top
    level and its text model's keys. ``gelu``: the family's MLP is GELU(tanh)-gated (Gemma,
    whose transformers code reads ``hidden_activation``)."""
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if gelu:
        act = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"{arch} with hidden_activation={act!r} is not supported "
                                        "(gelu_pytorch_tanh-gated MLPs only)")
    elif act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported (SiLU-gated MLPs only)")
    if d.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch} with mlp_bias=true is not supported")
    if d.get("attention_bias") and not qkv_bias:
        raise UnsupportedModelError(f"{arch} with attention_bias=true (biases on q, k, v and o) is not supported; "
                                    f"Qwen2's q/k/v biases are")


def moe_facts(d: dict[str, Any], always_norm_topk: bool, sparse_step: bool) -> dict[str, Any]:
    """The expert facts of a MoE config.json (``num_experts`` is ``num_local_experts`` in
    Mixtral's and in what newer transformers writes for Qwen3-MoE). ``decoder_sparse_step``
    and ``mlp_only_layers`` are read only where the family has them (``sparse_step``):
    transformers' Mixtral and Qwen3.5-MoE route every layer whatever they say."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    k = int(d.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < k <= experts:
        raise UnsupportedModelError(f"mixture-of-experts config with num_experts={experts}, num_experts_per_tok={k}")
    step = d.get("decoder_sparse_step") if sparse_step else None
    step = 1 if step is None else int(step)
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step}: expert layers are every step-th layer, step >= 1")
    return dict(
        num_experts=experts,
        num_experts_per_tok=k,
        # Mixtral's experts are sized by intermediate_size (it has no dense layers).
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=always_norm_topk or bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(x) for x in d.get("mlp_only_layers") or ()) if sparse_step else (),
    )


def layer_sliding_facts(d: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types) of a family whose layers slide or not one by one (Qwen2, Qwen3),
    as transformers decides: no window unless use_sliding_window; then ``layer_types`` as
    config.json gives it, else the layers from ``max_window_layers`` on slide."""
    if not d.get("use_sliding_window"):
        return None, ()
    window = d.get("sliding_window")
    if not window:
        return None, ()
    if int(window) < 1:
        raise UnsupportedModelError(f"sliding_window={window}: at least 1")
    first = int(d.get("max_window_layers", 28))
    types = tuple(d.get("layer_types") or ("sliding_attention" if i >= first else "full_attention"
                                           for i in range(num_layers)))
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {list(types)!r} for {num_layers} layers")
    return int(window), types
