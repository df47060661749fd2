"""Weight formats: a second format, defined here and registered through the public registry
(one class plus one registry entry), loads a block-scaled checkpoint of each kind of family
and scores as transformers' float32 forward of the unscaled weights; its scales are sliced
with each tensor-parallel rank's weights; formats that are not built are refused by name,
and a shard that would cut a scale block is refused when the model is built (a fused
projection whose parts cut them is held in the model dtype). The FP8 formats: test_fp8.py."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_parity import check, family_rng, make_requests
from torch import nn

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.layers.formats import FORMATS, register_format
from teacher_server.layers.formats.base import GroupedMM, WeightFormat, extra_name
from teacher_server.layers.formats.unquantized import UNQUANTIZED
from teacher_server.layers.linear import MergedColumnLinear, RowLinear
from teacher_server.layers.moe import ExpertWeights
from teacher_server.layers.parallel import TensorParallel
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec, UnsupportedModelError

CPU = torch.device("cpu")
METHOD = "test_block_scaled"
SCALE = "weight_scale_inv"


class BlockScaled(WeightFormat):
    """Weights stored divided by a power-of-two scale per [rows, cols] block, with the
    scales beside them (``<name>.weight_scale_inv``, as block-wise FP8 checkpoints): the
    product dequantizes, exactly, and multiplies in float32. The embedding stays plain; no
    fused residual and no plain weight, so the layers' fallbacks run."""

    name = METHOD

    def __init__(self, block: tuple[int, int]) -> None:
        self.extras = {SCALE: block}  # (per instance: the block is the checkpoint's)
        self.processed = 0

    def for_layer(self, role: str) -> WeightFormat:
        return UNQUANTIZED if role == "embedding" else self

    def create(self, layer: nn.Module, slot: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
        (r, c), (out, inp) = self.extras[SCALE], shape[-2:]
        setattr(layer, slot, nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False))
        scales = torch.empty(*shape[:-2], -(-out // r), -(-inp // c), dtype=torch.float32, device=device)
        setattr(layer, extra_name(slot, SCALE), nn.Parameter(scales, requires_grad=False))

    def dequantized(self, layer: nn.Module, slot: str = "weight") -> torch.Tensor:
        (r, c), w = self.extras[SCALE], getattr(layer, slot)
        s = getattr(layer, extra_name(slot, SCALE)).repeat_interleave(r, -2).repeat_interleave(c, -1)
        return w * s[..., :w.shape[-2], :w.shape[-1]]  # [..., out, in]

    def init_random(self, layer: nn.Module, param: str, gen: torch.Generator) -> None:
        if param.endswith(SCALE):  # positive powers of two, as the checkpoints hold
            p = getattr(layer, param)
            p.copy_(2.0 ** torch.randint(-3, 4, p.shape, generator=gen))
        else:
            super().init_random(layer, param, gen)

    def process_after_load(self, layer: nn.Module) -> None:
        for name, p in layer.named_parameters(recurse=False):
            if name.endswith(SCALE) and not bool((p > 0).all()):
                raise ValueError(f"{name}: scales must be positive")
        self.processed += 1

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, self.dequantized(layer), layer.bias)
        return y if out is None else out.copy_(y)

    def apply_experts(self, layer: nn.Module, slot: str, x: torch.Tensor, offs: torch.Tensor,
                      gemm: GroupedMM) -> torch.Tensor:
        return gemm(x, self.dequantized(layer, slot).transpose(1, 2), offs)


@pytest.fixture
def block_scaled() -> Iterator[list[BlockScaled]]:
    """The format registered for the test (the formats the engine made, newest last)."""
    made: list[BlockScaled] = []

    @register_format(METHOD)
    def _make(config: dict) -> WeightFormat:
        made.append(BlockScaled(tuple(config["weight_block_size"])))
        return made[-1]

    yield made
    del FORMATS[METHOD]


# The checkpoint tensors the format holds: every projection of the layers and the LM head (the
# embedding, norms, routers and the linear layers' own parameters stay as they are).
QUANTIZED = re.compile(r"(_proj|_proj_(qkv|z|b|a)|\.w[123]|^lm_head)\.weight$")


def block_scale(src: Path, dst: Path, block: tuple[int, int], seed: int = 0) -> Path:
    """A copy of checkpoint ``src`` whose projections are stored divided by a random power of
    two per block (2^-3 .. 2^3) with the scales as ``<name>.weight_scale_inv``; config.json
    names the format and its block."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": METHOD, "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    (r, c), tensors = block, load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if QUANTIZED.search(n) and "visual" not in n]:
        w = tensors[name]  # [out, in]
        s = 2.0 ** torch.randint(-3, 4, (-(-w.shape[0] // r), -(-w.shape[1] // c)), generator=gen).float()
        tensors[name] = w / s.repeat_interleave(r, 0).repeat_interleave(c, 1)[:w.shape[0], :w.shape[1]]
        tensors[name.removesuffix("weight") + SCALE] = s
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("family", "block"), [
    ("qwen3", (16, 48)),  # column blocks that end part-way (64 = 48 + 16)
    ("qwen2moe", (16, 16)),  # q/k/v biases, routed and shared experts, dense layers
    ("mixtral", (8, 16)),  # experts named w1 / w3 / w2
    ("qwen3_5", (4, 16)),  # Gated DeltaNet in-projection parts (b, a: 4 rows each) and gated attention
    ("qwen3_5_moe", (4, 16)),
])
def test_a_block_scaled_checkpoint_scores_as_transformers(family: str, block: tuple[int, int], checkpoints,
                                                          block_scaled: list[BlockScaled], tmp_path) -> None:
    """A format defined in this file and registered by ``register_format`` loads its
    checkpoint (weights and their scales by name) and scores within the float32 tolerance of
    transformers on the unscaled checkpoint, with the residual added after the product (the
    format fuses none) and the fused gate/up kernel skipped (it holds no plain weight)."""
    path = checkpoints[family]
    scaled = block_scale(path, tmp_path / "scaled", block)
    assert ModelSpec.from_dir(scaled).weight_format == METHOD
    eng = Engine(Config(model=str(scaled), device="cpu", max_num_batched_tokens=32, block_size=8,
                        num_kv_blocks=256, max_model_len=512))
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    fmt = block_scaled[-1]
    assert eng.model.weight_format is fmt and eng.model.lm_head is None  # a scaled head: no plain weight
    layers = [m for m in eng.model.modules() if getattr(m, "fmt", None) is fmt]
    assert fmt.processed == len(layers) > 0
    assert eng.model.embed_tokens.fmt is UNQUANTIZED
    reqs = make_requests(family_rng(family))
    check(path, reqs, eng.run_to_completion(reqs))


def test_each_rank_holds_the_scales_of_its_slice(checkpoints, block_scaled: list[BlockScaled], tmp_path) -> None:
    """At tensor parallel 2 each rank's weights, dequantized with the scales it read, are its
    slice of the whole model's: fused parts (one KV head each), input columns, vocab rows and
    both expert stacks."""
    scaled = block_scale(checkpoints["qwen3moe"], tmp_path / "scaled", (8, 16))
    spec = ModelSpec.from_dir(scaled)
    full = load_model(scaled, spec, torch.float32, CPU)
    ranks = [load_model(scaled, spec, torch.float32, CPU, tp=TensorParallel(2, r)) for r in range(2)]
    fmt = full.weight_format
    checked = 0
    for name, m in full.named_modules():
        if getattr(m, "fmt", None) is not fmt:
            continue
        shards = [rank.get_submodule(name) for rank in ranks]
        if isinstance(m, ExpertWeights):
            n = shards[0].i_local
            gate, up = fmt.dequantized(m, "gate_up").chunk(2, dim=1)
            for r, s in enumerate(shards):
                mine = slice(r * n, (r + 1) * n)
                torch.testing.assert_close(fmt.dequantized(s, "gate_up"), torch.cat([gate[:, mine], up[:, mine]], 1),
                                           rtol=0, atol=0)
                torch.testing.assert_close(fmt.dequantized(s, "down"), fmt.dequantized(m, "down")[:, :, mine],
                                           rtol=0, atol=0)
        elif isinstance(m, MergedColumnLinear):
            for s in shards:
                for part, (at, n) in s.parts.items():
                    start = m.parts[part][0] + s.sources[part][0]
                    torch.testing.assert_close(fmt.dequantized(s)[at:at + n], fmt.dequantized(m)[start:start + n],
                                               rtol=0, atol=0)
        else:  # row-parallel: input columns; the LM head: vocab rows
            dim = 1 if isinstance(m, RowLinear) else 0
            torch.testing.assert_close(torch.cat([fmt.dequantized(s) for s in shards], dim), fmt.dequantized(m),
                                       rtol=0, atol=0)
        checked += 1
    assert checked == 1 + 3 * 2 + 2 + 2  # head; qkv, o in 3 layers; a dense MLP; two expert layers


def test_a_shard_that_cuts_a_block_is_refused_when_built(checkpoints, block_scaled: list[BlockScaled],
                                                         tmp_path) -> None:
    """Scale blocks must not straddle two ranks: the model is not built. A fused projection
    whose parts cut the blocks is held in the model dtype instead."""
    wide = block_scale(checkpoints["qwen3"], tmp_path / "wide", (16, 48))
    spec = ModelSpec.from_dir(wide)
    load_model(wide, spec, torch.float32, CPU, load_format="dummy")  # tp 1: the column blocks end the axis
    with pytest.raises(ValueError, match=r"input columns: columns \[0, 64\) of 128 are not whole 48-column blocks"):
        load_model(wide, spec, torch.float32, CPU, load_format="dummy", tp=TensorParallel(2, 0))
    # fused parts that cut the blocks (q: 128 rows of 48-row blocks): that projection is held
    # in the model dtype (its parts dequantized as read), the others in the format
    tall = block_scale(checkpoints["qwen3"], tmp_path / "tall", (48, 16))
    model = load_model(tall, ModelSpec.from_dir(tall), torch.float32, CPU, load_format="dummy")
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.fmt is UNQUANTIZED and attn.o_proj.fmt is model.weight_format


BASE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8}


@pytest.mark.parametrize(("config", "says"), [
    ({"quant_method": "fbgemm_fp8"}, "quant_method 'fbgemm_fp8' (FP8 weights with per-row scales)"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_method 'modelopt'"),
    ({"quant_method": "fp8_online"}, "quant_method 'fp8_online' (an unknown method)"),  # chosen by a flag only
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"quant_method": "sparkle"}, "quant_method 'sparkle' (an unknown method)"),
    ({"bits": 4}, "quant_method None"),
])
def test_a_format_that_is_not_built_is_refused_by_name(config: dict, says: str) -> None:
    """A quantization_config whose method is not registered is refused, naming it and the
    formats that are built; none (or an empty one) is the unquantized format."""
    with pytest.raises(UnsupportedModelError, match=re.escape(says)) as err:
        ModelSpec.from_dict({**BASE, "quantization_config": config})
    assert "quantized checkpoints" in str(err.value) and "weight formats built: unquantized" in str(err.value)
    for plain in (BASE, {**BASE, "quantization_config": {}}):
        spec = ModelSpec.from_dict(plain)
        assert (spec.weight_format, spec.quantization_config) == ("unquantized", {})


def test_a_registered_format_is_chosen_by_the_spec(block_scaled: list[BlockScaled]) -> None:
    """config.json's quant_method picks the registered format; the spec keeps its config."""
    config = {"quant_method": METHOD, "weight_block_size": [16, 16]}
    spec = ModelSpec.from_dict({**BASE, "quantization_config": config})
    assert (spec.weight_format, spec.quantization_config) == (METHOD, config)


def test_the_unquantized_format_is_todays_layer() -> None:
    """Unquantized: ``weight`` in the model dtype (``gate_up`` and ``down`` for experts), the
    same products as torch's, the residual added in the GEMM (in place) and the plain weight
    for fused kernels."""
    g = torch.Generator().manual_seed(0)
    lin = RowLinear(24, 16, torch.float32, CPU)
    lin.weight.data.copy_(torch.randn(16, 24, generator=g))
    a, x = torch.randn(5, 24, generator=g), torch.randn(5, 16, generator=g)
    assert [n for n, _ in lin.named_parameters()] == ["weight"] and lin.fmt.dense(lin) is lin.weight
    torch.testing.assert_close(lin(a), a @ lin.weight.t(), rtol=0, atol=0)
    want = torch.addmm(x, a, lin.weight.t())
    y = x.clone()
    assert lin.add_into(y, a) is y
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    ex = ExpertWeights(4, 8, 6, torch.float32, CPU)
    assert [n for n, _ in ex.named_parameters()] == ["gate_up", "down"]
    assert (ex.gate_up.shape, ex.down.shape) == ((4, 12, 8), (4, 8, 6))
