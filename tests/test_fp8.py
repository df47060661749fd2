"""FP8 checkpoints (docs/fp8.md): each published layout (block-wise with weight_scale_inv or
weight_scale, compressed-tensors per channel and per tensor with dynamic or static activation
scales) and a bf16 checkpoint quantized at load (--quantization fp8) load and score within
the float32 tolerance of transformers on the dequantized weights, for dense, mixture-of-experts
and Qwen3.5 models (a fused layer with bf16 parts held in the model dtype); TP2 on gloo equals
TP1; the GPU dispatch (block-wise and row-wise scaled products, grouped expert product, experts
requantized per row) run through ops.fp8's definitions; what is not built, a shard that cuts a
scale block and a missing scale are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8util import make_fp8, quantize_block, quantize_rows
from test_parity import check, family_rng, make_requests
from test_tensor_parallel import assert_same, run

from teacher_server.cli import build_parser
from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.layers.formats import fp8 as fp8_format
from teacher_server.layers.formats.fp8 import Fp8Weights, quantize_weight_rows
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.parallel import TensorParallel
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec, UnsupportedModelError
from teacher_server.ops import fp8 as ops

CPU = torch.device("cpu")
# Qwen3.5-27B-FP8 keeps the linear layers' b and a in-projections in bf16 (its ignore list)
QWEN3_5_IGNORE = ("in_proj_a", "in_proj_b")


def engine(path: Path, **settings: object) -> Engine:
    return Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8, num_kv_blocks=256,
                         max_model_len=512, **settings))


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoints, tmp_path_factory):
    """(family, layout, block, ignore) -> (FP8 checkpoint, dequantized twin), made once."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def get(family: str, layout: str, block: tuple[int, int] = (16, 16),
            ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
        key = (family, layout, block, ignore)
        if key not in made:
            made[key] = make_fp8(checkpoints[family], tmp_path_factory.mktemp("fp8"), layout, block, ignore)
        return made[key]

    return get


@pytest.mark.parametrize(("family", "layout", "block", "ignore"), [
    ("qwen3", "block", (32, 32), ("layers.1.mlp.down_proj",)),  # one projection kept in bf16
    ("qwen3", "block_ws", (32, 16), ()),
    ("qwen3", "ct_channel", (16, 16), ()),
    ("qwen3", "ct_tensor_static", (16, 16), ()),  # fused q/k/v, gate/up: each part its own scale
    ("qwen3", "online", (16, 16), ()),
    ("qwen3moe", "block", (16, 16), ()),  # experts' per-expert weights and scales, a dense layer
    ("qwen3moe", "ct_tensor_static", (16, 16), ()),
    ("qwen2moe", "ct_channel", (16, 16), ()),  # a shared expert, q/k/v biases
    ("qwen3moe", "online", (16, 16), ()),
    ("qwen3_5", "block", (16, 16), QWEN3_5_IGNORE),  # in_proj: fp8 q/k/v/z, bf16 b/a -> held whole in fp32
    ("qwen3_5_moe", "ct_channel", (16, 16), ()),
])
def test_an_fp8_checkpoint_scores_as_transformers_on_its_dequantized_weights(
        family: str, layout: str, block: tuple[int, int], ignore: tuple[str, ...], fp8_checkpoints) -> None:
    path, twin = fp8_checkpoints(family, layout, block, ignore)
    eng = engine(path, quantization="fp8" if layout == "online" else None)
    want = {"block": "fp8", "block_ws": "fp8", "online": "fp8_online"}.get(layout, "compressed-tensors")
    assert eng.spec.weight_format == want and isinstance(eng.model.weight_format, Fp8Weights)
    # on the CPU every layer is held dequantized, in the model dtype
    assert all(getattr(m, "fmt", UNQUANTIZED) is UNQUANTIZED for m in eng.model.modules())
    reqs = make_requests(family_rng(family))
    check(twin, reqs, eng.run_to_completion(reqs))
