"""The Gemma-3-27B and GLM-4.5-Air bench shapes: they read as their families with the published
dimensions (GLM-4.5-Air's against transformers' Glm4MoeConfig defaults, which are its), and
the FLOP count gives Gemma's local layers their window of keys, not the whole context."""

from __future__ import annotations

import numpy as np

from teacher_server.benchmark.workloads import GEMMA3_27B, GLM45_AIR_LAYERS, Req, flops
from teacher_server.models.spec import ModelSpec


def test_shapes_read_as_their_families() -> None:
    import transformers as tf

    g = ModelSpec.from_dict(GEMMA3_27B)
    assert (g.family, g.num_layers, g.head_dim, g.gemma.query_pre_attn_scalar) == ("gemma3", 62, 128, 168)
    assert sum(g.layer_window(i) == 1024 for i in range(62)) == 52
    glm = ModelSpec.from_dict(GLM45_AIR_LAYERS)
    assert (glm.family, glm.rotary_dim, glm.num_experts, glm.mlp_only_layers) == ("glm4_moe", 64, 128, (0,))
    ref = tf.Glm4MoeConfig()
    for key, value in GLM45_AIR_LAYERS.items():
        if key not in ("num_hidden_layers", "architectures", "model_type", "torch_dtype", "attention_bias",
                       "num_nextn_predict_layers", "head_dim", "partial_rotary_factor", "rope_theta"):
            assert getattr(ref, key) == value, key


def test_flops_count_the_window_of_local_layers() -> None:
    n, rows, w = 4096, 3072, 1024
    req = Req(np.zeros(n, np.int64), n - 1 - rows, np.zeros((rows, 1), np.int32))
    params = ModelSpec.from_dict(GEMMA3_27B).non_embedding_params()
    q = 32 * 128
    pairs = 10 * n * n + 52 * 2 * (w * w / 2 + (n - w) * w)
    assert flops(GEMMA3_27B, [req]) == 2 * params * n + 2 * q * pairs + 2 * 5376 * 262208 * rows
    # a cached prefix of 2048: the local layers' pairs of the rest only
    rest = 10 * (n * n - 2048 * 2048) + 52 * 2 * ((n - 2048) * w)
    assert flops(GEMMA3_27B, [req], computed_only=True, cached=[2048]) == (
        2 * params * (n - 2048) + 2 * q * rest + 2 * 5376 * 262208 * rows)


def test_a_shape_cut_to_fewer_layers_keeps_its_layer_pattern_and_per_layer_flops() -> None:
    from teacher_server.benchmark.workloads import QWEN3_NEXT_80B_A3B_LAYERS, with_layers

    cut = with_layers(QWEN3_NEXT_80B_A3B_LAYERS, 12)
    spec = ModelSpec.from_dict(cut)
    assert spec.num_layers == 12 and cut["layer_types"] == QWEN3_NEXT_80B_A3B_LAYERS["layer_types"][:12]
    assert [spec.layer_types[i] for i in (2, 3, 11)] == ["linear_attention", "full_attention", "full_attention"]
    assert QWEN3_NEXT_80B_A3B_LAYERS["num_hidden_layers"] == 24  # the shape itself untouched
    full = ModelSpec.from_dict(QWEN3_NEXT_80B_A3B_LAYERS).non_embedding_params()
    assert spec.non_embedding_params() * 2 == full  # 12 of 24 layers of one repeating pattern: half
    g = ModelSpec.from_dict(with_layers(GEMMA3_27B, 36))
    assert sum(g.layer_window(i) == 1024 for i in range(36)) == 30  # 5 local : 1 global, as the whole


def test_the_baseline_batch_shrinks_only_where_its_logits_would_not_fit(monkeypatch) -> None:
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import hf_baseline

    assert hf_baseline.fitting_batch(GEMMA3_27B, 4096) == 32768  # no GPU: DESIGN's batch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (24 * 2**30, 80 * 2**30))
    assert hf_baseline.fitting_batch(GEMMA3_27B, 4096) == 4096  # 262k vocab in 24 GiB: one request a batch
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 2**30, 140 * 2**30))
    assert hf_baseline.fitting_batch(dict(GEMMA3_27B, vocab_size=151936), 4096) == 32768
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**30, 80 * 2**30))
    assert hf_baseline.fitting_batch(GEMMA3_27B, 8192) == 8192  # never below one request
