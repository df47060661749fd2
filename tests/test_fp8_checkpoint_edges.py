"""FP8 checkpoints at their edges (docs/fp8.md): per-channel scales stored 1-D where their layer
is held in the model dtype score as transformers on the dequantized weights; a weight's scales
under both spellings, a NaN or infinite scale, integer weights and e4m3 codes without a
quantization_config are refused by name, as is a tensor given twice, instead of loading as a
traceback, NaN scores or raw codes read as weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fp8util import make_fp8
from safetensors.torch import load_file, save_file
from test_fp8 import engine, requests
from test_parity import check

from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec, UnsupportedModelError

CPU = torch.device("cpu")


def edited(src: Path, dst: Path, tensors: Callable[[dict], None] | None = None,
           config: Callable[[dict], None] | None = None) -> Path:
    """A copy of checkpoint ``src`` with its tensors and config.json changed in place by the functions given."""
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def load(path: Path) -> None:
    load_model(path, ModelSpec.from_dir(path), torch.float32, CPU)


@pytest.fixture(scope="module")
def channel_kept(checkpoints, tmp_path_factory):
    """qwen3 in compressed-tensors' per-channel layout with k_proj kept in bf16 (so the fused
    q/k/v is held in the model dtype, its FP8 parts dequantized as read), and its twin."""
    return make_fp8(checkpoints["qwen3"], tmp_path_factory.mktemp("ch"), "ct_channel", (16, 16),
                    ("layers.0.self_attn.k_proj",))


@pytest.fixture(scope="module")
def block(checkpoints, tmp_path_factory):
    return make_fp8(checkpoints["qwen3"], tmp_path_factory.mktemp("blk"), "block", (16, 16))


def test_per_channel_scales_stored_1d_score_where_the_layer_is_held_dequantized(channel_kept, tmp_path) -> None:
    """A [N] channel scale (a shape the format takes) read to dequantize a fused projection
    held in the model dtype (it failed there as an IndexError naming no tensor)."""
    path, twin = channel_kept

    def flat(t: dict) -> None:
        for k in [k for k in t if k.endswith("weight_scale")]:
            t[k] = t[k].reshape(-1).contiguous()

    one_d = edited(path, tmp_path / "flat", flat)
    reqs = requests("qwen3")
    check(twin, reqs, engine(one_d).run_to_completion(reqs))


def test_scales_under_both_spellings_are_refused_naming_both(block, tmp_path) -> None:
    path, _ = block
    name = "model.layers.0.self_attn.o_proj.weight_scale"

    def both(t: dict) -> None:
        t[name] = t[name + "_inv"].clone()

    with pytest.raises(UnsupportedModelError, match=f"{name}_inv and {name} are both scales of"):
        load(edited(path, tmp_path / "both", both))


@pytest.mark.parametrize(("which", "name", "value"), [
    ("block", "model.layers.0.self_attn.q_proj.weight_scale_inv", float("nan")),  # block scales, layer held FP8
    ("block", "model.layers.1.mlp.down_proj.weight_scale_inv", float("inf")),
    ("channel_kept", "model.layers.1.mlp.up_proj.weight_scale", float("nan")),  # per-row scales, held FP8
    ("channel_kept", "model.layers.0.self_attn.q_proj.weight_scale", float("inf")),  # dequantized as read
])
def test_a_nan_or_infinite_scale_is_refused_by_name(which: str, name: str, value: float, request,
                                                    tmp_path) -> None:
    """Such a scale made every score of the server NaN (answered 200)."""
    path, _ = request.getfixturevalue(which)

    def spoil(t: dict) -> None:
        t[name] = t[name].clone()
        t[name].view(-1)[0] = value

    with pytest.raises(UnsupportedModelError, match=f"checkpoint tensor {name} holds a NaN or infinite scale"):
        load(edited(path, tmp_path / "bad", spoil))


def test_integer_weights_in_an_fp8_checkpoint_are_refused_by_name(block, tmp_path) -> None:
    """An int8 weight beside its scale was taken as a weight kept in bf16: its codes were the weights."""
    path, _ = block
    name = "model.layers.0.self_attn.k_proj.weight"

    def to_int8(t: dict) -> None:
        t[name] = t[name].float().round().clamp(-127, 127).to(torch.int8)

    with pytest.raises(UnsupportedModelError, match=f"checkpoint tensor {name} is I8; weights must be e4m3"):
        load(edited(path, tmp_path / "i8", to_int8))


def test_fp8_codes_without_a_quantization_config_are_refused_by_name(block, tmp_path) -> None:
    """e4m3 weights in a checkpoint whose config.json names no quantization: their codes loaded as weights."""
    path, _ = block

    def plain(c: dict) -> None:
        del c["quantization_config"]

    def no_scales(t: dict) -> None:
        for k in [k for k in t if k.endswith("weight_scale_inv")]:
            del t[k]

    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\S+\.weight is F8_E4M3, quantized codes, and "
                                         "config.json names no quantization_config"):
        load(edited(path, tmp_path / "plain", no_scales, plain))


def test_a_weight_given_twice_is_named_as_such(checkpoints, tmp_path) -> None:
    """The same tensor in two files of a sharded checkpoint: named as given twice (it was
    reported as missing)."""
    src = checkpoints["qwen3"]
    dst = tmp_path / "twice"
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({name: t[name]}, str(dst / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"gives these weights more than once .*: {name} \\+ {name}$"):
        load(dst)
