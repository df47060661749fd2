"""The Qwen3.5-9B benchmark (W7) on the CPU: its shape is transformers' Qwen3_5TextConfig
defaults, its random checkpoint has exactly the tensors transformers' model has, its FLOP count
follows the MFU rule for hybrid models, and the whole benchmark path (written checkpoint,
packed-or-padded transformers baseline in its own process, engine W1 and W2 with the prefix cache
off and on, the baseline check) runs on a small model of the same family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from teacher_server.models.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_engine
from workloads import QWEN3_5_9B, QWEN3_5_35B_A3B, Req, flops, make_workload, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _assert_defaults(shape: dict, config_class: str) -> None:
    """Every key of ``shape`` (bar the ones transformers' config does not hold) is the default
    of transformers' ``config_class``."""
    import transformers as tf

    ref = getattr(tf, config_class)().to_dict()
    for key, value in shape.items():
        if key in ("architectures", "torch_dtype", "attention_bias", "hidden_act"):
            continue
        if key == "rope_parameters":
            assert {k: ref[key][k] for k in value} == value
        else:
            assert ref[key] == value, key


def test_shape_is_transformers_default() -> None:
    _assert_defaults(QWEN3_5_9B, "Qwen3_5TextConfig")
    spec = ModelSpec.from_dict(QWEN3_5_9B)
    assert len(spec.kv_layer_ids) == 8 and len(spec.linear_layer_ids) == 24 and spec.rotary_dim == 64


def test_moe_shape_is_transformers_default() -> None:
    """The Qwen3.5-35B-A3B shape is transformers' Qwen3_5MoeTextConfig defaults: 40 hybrid
    layers (10 full attention), 256 experts top-8 of 512 with a shared expert of 512."""
    _assert_defaults(QWEN3_5_35B_A3B, "Qwen3_5MoeTextConfig")
    spec = ModelSpec.from_dict(QWEN3_5_35B_A3B)
    assert spec.family == "qwen3_5_moe" and len(spec.kv_layer_ids) == 10 and len(spec.linear_layer_ids) == 30
    assert (spec.num_experts, spec.num_experts_per_tok) == (256, 8) and all(spec.is_moe_layer(i) for i in range(40))


def test_flops_count_linear_layers_by_parameters() -> None:
    """Per token: 2 x non-embedding parameters (transformers' model without its embedding and
    head, ~9B in all), attention only in the 8 full-attention layers, the LM head per scored row."""
    import transformers as tf

    spec = ModelSpec.from_dict(QWEN3_5_9B)
    params = spec.non_embedding_params()
    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig())
    theirs = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    assert abs(params - theirs) < 1e-4 * theirs, (params, theirs)  # norms, A_log and dt_bias aside
    assert 8.9e9 < params + 2 * 248320 * 4096 < 9.1e9
    n, rows = 1000, 400
    req = Req(np.zeros(n, np.int64), n - 1 - rows, np.zeros((rows, 1), np.int32))
    want = 2 * params * n + 2 * 8 * 16 * 256 * n * n + 2 * 4096 * 248320 * rows
    assert flops(QWEN3_5_9B, [req]) == want
    # with a cached prefix of 512 tokens only the rest is computed
    assert flops(QWEN3_5_9B, [req], computed_only=True, cached=[512]) == (
        2 * params * (n - 512) + 2 * 8 * 16 * 256 * (n * n - 512 * 512) + 2 * 4096 * 248320 * rows)


def test_random_checkpoint_has_transformers_tensors(tmp_path) -> None:
    """The written checkpoint (small model of the family) loads into transformers' Qwen3.5 with
    no tensor missing or left over, and its forward is finite and not flat."""
    import transformers as tf

    cfg = bench_engine.tiny(QWEN3_5_9B)
    write_random_checkpoint(tmp_path, cfg)
    model, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.arange(64)[None] * 7).logits[0], -1)
    assert torch.isfinite(lp).all() and float(lp.std()) > 0.1


def test_tiny_workloads() -> None:
    w1, w2 = make_workload("W1:tiny", 4096), make_workload("W2:tiny", 4096)
    assert len(w1) == 8 and all(r.cand.shape == (r.rows, 8) for r in w1)
    assert len(w2) == 16 and len({r.tokens[:48].tobytes() for r in w2}) == 2 and all(r.start == 47 for r in w2)


@pytest.mark.parametrize("size", ["qwen3.5-9b"])
def test_benchmark_runs_on_a_small_model(tmp_path, size: str) -> None:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_engine.py"), "--model-size", size, "--tiny",
           "--workloads", "W1:tiny", "--baseline", "W1:tiny,W2:tiny", "--prefix-cache-compare", "W2:tiny",
           "--baseline-layouts", "auto,padded",
           "--repeats", "1", "--max-model-len", "512", "--ckpt-dir", str(tmp_path), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600)
    res = json.loads(out.read_text())
    assert res["engine"]["W1:tiny"]["tokens_per_s"] > 0 and res["baseline"]["W1:tiny"]["tokens_per_s"] > 0
    assert res["prefix_cache"]["W2:tiny"]["on"]["seconds"] > 0
    # both float32 on the CPU (from bf16 weights); bf16 on a GPU
    tol = 0.1 if torch.cuda.is_available() else 1e-3
    for name in ("W1:tiny", "W2:tiny", "W1:tiny@padded", "W2:tiny@padded"):
        assert res["baseline_check"][name]["max_abs_diff"] < tol, res["baseline_check"]
    # the second layout: DESIGN's left-padded recipe, with its own ratio
    assert res["baseline"]["W1:tiny@padded"]["layout"] == "padded"
    assert res["summary"]["W1:tiny@padded_x_transformers"] > 0
