"""The GLM-4.5/4.6 facts of a config.json (``Glm4MoeForCausalLM``, GLM-4.5-Air included):
DeepSeek-V3's expert routing (``layers.deepseek_moe.ExpertRouting``: sigmoid scores, the
score-correction bias that only picks, group-limited top-k, ``routed_scaling_factor``), its
ungated shared experts, ``first_k_dense_replace`` dense layers, rotary on the first
``partial_rotary_factor`` of each head (0.5 when config.json does not say, as transformers)
and the optional per-head q/k RMSNorm (``use_qk_norm``).

What changes the math and is not built is refused by name (biases on o_proj or on the MLPs:
``spec.refuse_unbuilt``; groups that cannot be scored)."""

from __future__ import annotations

from typing import Any

from teacher_server.layers.deepseek_moe import ExpertRouting
from teacher_server.unsupported import UnsupportedModelError


def glm4_moe_facts(d: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a GLM-4.5 config (d holds the registry's defaults under the
    file's keys; ``rope_params`` its ``rope_parameters``, where transformers 5 writes the
    partial rotary factor)."""
    experts = int(d.get("n_routed_experts") or 0)
    k = int(d.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < k <= experts:
        raise UnsupportedModelError(f"Glm4MoeForCausalLM with n_routed_experts={experts}, num_experts_per_tok={k}")
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if experts % n_group or not 0 < topk_group <= n_group:
        raise UnsupportedModelError(f"Glm4MoeForCausalLM: {experts} experts in n_group={n_group} groups, "
                                    f"topk_group={topk_group}")
    if n_group > 1 and experts // n_group < 2:  # a group is scored by its two best experts
        raise UnsupportedModelError(f"Glm4MoeForCausalLM: groups of {experts // n_group} expert(s); the group score "
                                    "needs two")
    if k > topk_group * (experts // n_group):
        raise UnsupportedModelError(f"Glm4MoeForCausalLM: top-{k} experts from {topk_group} group(s) of "
                                    f"{experts // n_group}")
    factor = float(rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    if not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise UnsupportedModelError(f"Glm4MoeForCausalLM: partial_rotary_factor={factor} of head_dim {head_dim} "
                                    "(an even rotary width)")
    first_dense = min(int(d.get("first_k_dense_replace") or 0), int(d["num_hidden_layers"]))
    return dict(
        routing=ExpertRouting("sigmoid", "noaux_tc", n_group, topk_group, float(d.get("routed_scaling_factor") or 1.0),
                              correction_bias=True),
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        # the n_shared_experts shared experts are one MLP of their summed width
        shared_expert_intermediate_size=int(d["moe_intermediate_size"]) * int(d.get("n_shared_experts") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(range(first_dense)),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0),  # model.layers.<num_hidden_layers + i>
        partial_rotary_factor=factor,
    )
