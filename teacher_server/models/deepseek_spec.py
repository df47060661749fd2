"""The DeepSeek-V2/V3 facts of a config.json (multi-head latent attention and DeepSeekMoE
routing), read into two small records that ``ModelSpec`` carries: ``MlaDims`` and
``layers.deepseek_moe.ExpertRouting``. Kimi-K2 and Moonlight ship ``DeepseekV3ForCausalLM`` configs (Kimi-K2 with
``model_type: kimi_k2``); the keys are the same.

What changes the math and is not built is refused by name: a MoE layer frequency other
than 1, scoring or top-k methods other than the family's (biases on the attention
projections: ``spec.refuse_unbuilt``). The multi-token-prediction layers are skipped at load
(they do not score)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from teacher_server.layers.deepseek_moe import ExpertRouting
from teacher_server.unsupported import UnsupportedModelError

V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
# (scoring function, top-k methods) each family's transformers code computes
_ROUTING = {V3: ("sigmoid", ("noaux_tc",)), V2: ("softmax", ("greedy", "group_limited_greedy"))}


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention. Per token the layer keeps ``latent`` = kv_lora_rank +
    qk_rope_head_dim numbers (the normed latent and the rotated shared key), from which each
    head's key (qk_nope | rope, ``qk_dim`` wide) and value (``v_dim``) are made."""

    q_lora_rank: int  # 0: q is one projection of the hidden state (V2-Lite, Moonlight)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims are (x0, x1), (x2, x3), ... pairs

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_facts(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a DeepSeek-V2/V3 config.json (d holds the registry's
    defaults under the file's keys)."""
    layers = int(d["num_hidden_layers"])
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedModelError(f"{arch} with moe_layer_freq={d['moe_layer_freq']} is not supported "
                                    "(every layer from first_k_dense_replace on routes)")
    scoring, methods = _ROUTING[arch]
    given = d.get("scoring_func") or scoring
    method = d.get("topk_method") or methods[0]
    if given != scoring or method not in methods:
        raise UnsupportedModelError(f"{arch} with scoring_func={given!r}, topk_method={method!r} is not supported "
                                    f"({scoring} scoring with {' or '.join(methods)} is)")
    experts = int(d.get("n_routed_experts") or 0)
    k = int(d.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < k <= experts:
        raise UnsupportedModelError(f"{arch} with n_routed_experts={experts}, num_experts_per_tok={k}")
    grouped = arch == V3 or method == "group_limited_greedy"
    n_group = int(d.get("n_group") or 1) if grouped else 1
    topk_group = int(d.get("topk_group") or 1) if grouped else 1
    if experts % n_group or not 0 < topk_group <= n_group:
        raise UnsupportedModelError(f"{arch}: {experts} experts in n_group={n_group} groups, topk_group={topk_group}")
    if arch == V3 and experts // n_group < 2:  # a group is scored by its two best experts
        raise UnsupportedModelError(f"{arch}: groups of {experts // n_group} expert(s); the group score needs two")
    if k > topk_group * (experts // n_group):
        raise UnsupportedModelError(f"{arch}: top-{k} experts from {topk_group} group(s) of {experts // n_group}")
    q_lora = d.get("q_lora_rank")
    mla = MlaDims(int(q_lora or 0), int(d["kv_lora_rank"]), int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"]),
                  int(d["v_head_dim"]), bool(d.get("rope_interleave", True)) if arch == V3 else True)
    if mla.qk_rope_head_dim % 2 or min(mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim) < 1:
        raise UnsupportedModelError(f"{arch}: latent attention widths {mla}")
    first_dense = min(int(d.get("first_k_dense_replace") or 0), layers)
    routing = ExpertRouting(scoring, method, n_group, topk_group, float(d.get("routed_scaling_factor") or 1.0),
                            correction_bias=arch == V3)
    return dict(
        mla=mla,
        routing=routing,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        # the n_shared_experts shared experts are one MLP of their summed width
        shared_expert_intermediate_size=int(d["moe_intermediate_size"]) * int(d.get("n_shared_experts") or 0),
        # V2: transformers scales the top-k weights and never renormalises them, whatever the key says
        norm_topk_prob=arch == V3 and bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(range(first_dense)),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0),  # model.layers.<num_hidden_layers + i>
    )
