"""FP8 checkpoints (docs/fp8.md): each published layout (block-wise with weight_scale_inv or
weight_scale, compressed-tensors per channel and per tensor with dynamic or static activation
scales) and a bf16 checkpoint quantized at load (--quantization fp8) load and score within
the float32 tolerance of transformers on the dequantized weights, for dense, mixture-of-experts
and Qwen3.5 models (a fused layer with bf16 parts held in the model dtype); TP2 on gloo equals
TP1; the GPU dispatch (block-wise and row-wise scaled products, grouped expert products with
their blocks kept or requantized per row) run through ops.fp8's CPU references; what is not
built, a shard that cuts a scale block and a missing scale are refused by name; the accuracy
benchmark runs tiny."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8util import make_fp8, quantize_block, quantize_rows
from reference import reference_scores
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


def requests(family: str) -> list:
    """Five of the parity requests: one token, short per-row candidates with padding, flat
    candidates over 40 tokens, and two chunked per-row ones (150 and 97 tokens)."""
    reqs = make_requests(family_rng(family))
    return [reqs[i] for i in (0, 3, 5, 7, 9)]


def engine(path: Path, **settings: object) -> Engine:
    return Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8, num_kv_blocks=256,
                         max_model_len=512, **settings))


def moe_128(path: Path, layers: int = 1, inter: int = 128) -> Path:
    """A tiny Qwen3-MoE whose widths are whole 128-blocks (hidden 128, expert intermediate
    ``inter``): its block-scaled experts keep their blocks on the GPU."""
    import transformers as tf
    from reference import ROUTER, randomize_weights

    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=inter,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).float().eval()
    randomize_weights(model, (ROUTER,))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoints, tmp_path_factory):
    """(family, layout, block, ignore) -> (FP8 checkpoint, dequantized twin), made once."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def get(family: str, layout: str, block: tuple[int, int] = (16, 16),
            ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
        key = (family, layout, block, ignore)
        if key not in made:
            if family in ("moe128", "moe128x3", "moe256"):  # (x3: three expert layers; 256: two 128-groups of I)
                src = moe_128(tmp_path_factory.mktemp(family) / "m", 3 if family.endswith("x3") else 1,
                              256 if family == "moe256" else 128)
            elif family.startswith("deepseek_"):  # DeepSeek-V3-class (latent attention, DeepSeekMoE)
                from deepseek_ref import make_deepseek_checkpoint

                src = make_deepseek_checkpoint(family.removeprefix("deepseek_"), tmp_path_factory.mktemp("ds") / "m")
            elif family == "qwen3_next":  # its grouped in-projections (in_proj_qkvz, in_proj_ba) quantized too
                from oss_ref import make_qwen3_next_checkpoint

                src = make_qwen3_next_checkpoint(tmp_path_factory.mktemp("next") / "m")
            else:
                src = checkpoints[family]
            made[key] = make_fp8(src, tmp_path_factory.mktemp("fp8"), layout, block, ignore)
        return made[key]

    return get


@pytest.mark.parametrize(("family", "layout", "block", "ignore"), [
    ("qwen3", "block", (32, 32), ("layers.1.mlp.down_proj",)),  # one projection kept in bf16
    ("qwen3", "block_ws", (32, 16), ()),
    ("qwen3", "ct_channel", (16, 16), ()),
    ("qwen3", "ct_tensor_static", (16, 16), ()),  # fused q/k/v, gate/up: each part its own scale
    ("qwen3", "online", (16, 16), ()),
    ("qwen3", "ct_block", (32, 32), ()),  # llm-compressor's FP8_BLOCK
    ("qwen3", "fp8_tensor_static", (16, 16), ()),  # AutoFP8's per-tensor static
    ("qwen3moe", "block", (16, 16), ()),  # experts' per-expert weights and scales, a dense layer
    ("qwen3moe", "ct_tensor_static", (16, 16), ()),
    ("qwen2moe", "ct_channel", (16, 16), ()),  # a shared expert, q/k/v biases
    ("qwen3moe", "online", (16, 16), ()),
    ("qwen3_5", "block", (16, 16), QWEN3_5_IGNORE),  # in_proj: fp8 q/k/v/z, bf16 b/a -> held whole in fp32
    ("qwen3_5_moe", "ct_channel", (16, 16), ()),
    ("qwen3_5_vl", "block_ws", (16, 16), QWEN3_5_IGNORE),  # the vision-language checkpoint's text model
    ("qwen3_next", "online", (16, 16), ()),
    ("qwen3_next", "block", (16, 16), ()),
    ("deepseek_v3", "block", (16, 16), ()),  # DeepSeek-V3's own FP8 layout, latent attention and its MTP layer
    # q_b's input (q_lora_rank 48) one block column wide: its [N / 16, 1] block scale is not a per-row one
    ("deepseek_v3", "block", (16, 64), ()),
])
def test_an_fp8_checkpoint_scores_as_transformers_on_its_dequantized_weights(
        family: str, layout: str, block: tuple[int, int], ignore: tuple[str, ...], fp8_checkpoints) -> None:
    path, twin = fp8_checkpoints(family, layout, block, ignore)
    eng = engine(path, quantization="fp8" if layout == "online" else None)
    want = {"block": "fp8", "block_ws": "fp8", "fp8_tensor_static": "fp8", "online": "fp8_online"}.get(
        layout, "compressed-tensors")
    assert eng.spec.weight_format == want and isinstance(eng.model.weight_format, Fp8Weights)
    # on the CPU every layer is held dequantized, in the model dtype
    assert all(getattr(m, "fmt", UNQUANTIZED) is UNQUANTIZED for m in eng.model.modules())
    reqs = requests(family)
    check(twin, reqs, eng.run_to_completion(reqs))


def worst_error(twin: Path, reqs: list, results: list) -> float:
    """The largest absolute error of ``results`` against transformers on ``twin``."""
    worst = 0.0
    for q, r in zip(reqs, results):
        assert r.error is None, r.error
        if q.rows:
            ref = reference_scores(twin, q.token_ids.tolist(), q.candidates, q.start)
            fin = np.isfinite(ref)
            worst = max(worst, float(np.abs(r.token_id_logprobs[fin] - ref[fin]).max()))
    return worst


@pytest.mark.parametrize(("family", "layout", "block", "modes"), [
    ("qwen3hd128", "block", (128, 128), {"block"}),  # 1 x 128 activation groups, 128 x 128 weight blocks
    ("qwen3", "block", (32, 32), {"row"}),  # blocks torch's kernel does not take: requantized per row
    ("qwen3", "ct_tensor_static", (16, 16), {"row"}),  # the layer's largest input_scale, per-row weight scales
    ("qwen3moe", "block", (16, 16), {"row"}),  # experts requantized per row, the grouped product
    ("qwen3moe", "online", (16, 16), {"row"}),
    ("moe128", "block", (128, 128), {"block"}),  # experts keep their 128 x 128 blocks (grouped block product)
])
def test_the_gpu_dispatch_scores_within_the_fp8_activation_error(family: str, layout: str, block: tuple[int, int],
                                                                   modes: set[str], fp8_checkpoints,
                                                                   monkeypatch) -> None:
    """As on a GPU with FP8 multiplies, the products through ops.fp8 (here its plain-torch
    definitions, on the CPU): the weights stay e4m3, the activations are quantized as each
    layer's mode says, and the scores stay within the error of FP8 activations (tiny random
    models: a few hundredths of a nat) of the dequantized checkpoint's."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    fused = []  # the dense MLPs' down-projection inputs quantized in the SiLU-mul pass
    silu_mul_quant = ops.silu_mul_quant
    monkeypatch.setattr(ops, "silu_mul_quant", lambda *a, **kw: fused.append(1) or silu_mul_quant(*a, **kw))
    path, twin = fp8_checkpoints(family, layout, block)
    eng = engine(path, quantization="fp8" if layout == "online" else None)
    held = [m for m in eng.model.modules() if isinstance(getattr(m, "fmt", None), Fp8Weights)]
    assert held and all(getattr(m, m.slots[0]).dtype == ops.FP8 for m in held)
    assert {m.fmt.mode(m) for m in held if m.role != "experts"} == modes
    experts = [m for m in held if m.role == "experts"]
    assert all(m.fmt.mode(m) == ("block" if block == (128, 128) else "row") for m in experts)
    for m in experts:  # one scale per row, or per 128 x 128 block
        rows = m.gate_up.shape[1] if m.fmt.mode(m) == "row" else m.gate_up.shape[1] // 128
        assert m.gate_up_weight_scale_inv.shape[1:] == (rows, 1 if m.fmt.mode(m) == "row" else m.gate_up.shape[2] // 128)
    reqs = requests(family)
    worst = worst_error(twin, reqs, eng.run_to_completion(reqs))
    print(f"{family} {layout}: worst abs error {worst:.4f}")
    assert 1e-4 < worst < 1.0, worst
    assert fused  # the dense MLPs' and the experts' down-projection inputs


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("family", "layout", "block"), [
    ("qwen3hd128", "block", (128, 128)), ("qwen3", "ct_tensor_static", (16, 16)), ("qwen3moe", "block", (16, 16)),
    ("moe128", "block", (128, 128)), ("qwen3moe", "ct_tensor_static", (16, 16)), ("deepseek_v3", "block", (16, 16)),
])
def test_each_layers_fp8_product_is_its_weights_product_within_activation_rounding(
        family: str, layout: str, block: tuple[int, int], fp8_checkpoints, monkeypatch) -> None:
    """Layer by layer, as on a GPU: the FP8 product (``apply``, and ``apply_experts`` over
    rows sorted by expert) is x times the weight the layer holds (``Fp8Weights.weight``)
    within e4m3's rounding of the activations (a few percent; a scale misplaced by one block
    or expert would be far off)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    path, _ = fp8_checkpoints(family, layout, block)
    model = load_model(path, ModelSpec.from_dir(path), torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for m in model.modules():
        fmt = getattr(m, "fmt", None)
        if not isinstance(fmt, Fp8Weights):
            continue
        if m.role == "experts":
            e, _, k = m.gate_up.shape
            x = torch.randn(40, k, generator=gen)
            offs = torch.tensor([5 * (i + 1) for i in range(e - 1)] + [40], dtype=torch.int32)
            w = fmt.weight(m, "gate_up")
            want = torch.cat([x[lo:hi] @ w[i].t() for i, (lo, hi) in enumerate(zip([0, *offs[:-1].tolist()],
                                                                                  offs.tolist()))])
            got = fmt.apply_experts(m, "gate_up", x, offs, gemm=None)
        else:
            x = torch.randn(24, m.weight.shape[1], generator=gen)
            want = x @ fmt.weight(m).t() + (m.bias if m.bias is not None else 0)
            got = fmt.apply(m, x)
        assert relative(got, want) < 0.06, (type(m).__name__, relative(got, want))
        checked += 1
    assert checked >= 2
    experts = [m for m in model.modules() if getattr(m, "role", None) == "experts"]
    want = "block" if block == (128, 128) else "row"  # 128 x 128 blocks kept (the grouped block kernel)
    assert all(m.fmt.mode(m) == want for m in experts)


def test_block_scaled_weights_requantized_per_row_lose_little_more() -> None:
    """Where the 128 x 128 block multiply cannot run (another block size or width, a GPU
    without it), block-scaled weights are requantized per row at load. On weights whose blocks
    differ in magnitude (0.25x to 4x), the requantized weights are within the error block-wise
    quantization already has of the original weights (docs/fp8.md quotes both numbers)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=gen) * 0.02
    w *= (2.0 ** torch.randint(-2, 3, (4, 8), generator=gen).float()).repeat_interleave(128, 0).repeat_interleave(
        128, 1)
    q, s = quantize_block(w, (128, 128))
    block = ops.dequantize(q, s, "block")
    rq, rs = quantize_weight_rows(block)
    row = ops.dequantize(rq, rs, "row")
    first, extra = relative(block, w), relative(row, block)
    print(f"block-wise quantization error {first:.4f}; extra from the per-row requantization {extra:.4f}")
    assert extra < 1.5 * first and extra < 0.04, (first, extra)
    direct_q, direct_s = quantize_rows(w)  # the test's own per-row quantizer agrees with the server's
    torch.testing.assert_close(ops.dequantize(*quantize_weight_rows(w), "row"), ops.dequantize(direct_q, direct_s,
                                                                                                "row"), rtol=0, atol=0)


@pytest.mark.parametrize(("family", "layout", "settings"), [
    ("qwen3moe", "block", {}),  # experts split on 16-row blocks, their scales with them
    ("qwen3", "online", {"quantization": "fp8"}),  # row-parallel rows quantized with the whole row's amax
])
def test_tp2_equals_tp1(family: str, layout: str, settings: dict, fp8_checkpoints) -> None:
    path, _ = fp8_checkpoints(family, layout)
    one, _ = run(path, 1, **settings)
    two, _ = run(path, 2, **settings)
    assert_same(one, two)


def without(path: Path, dst: Path, name: str, instead: torch.Tensor | None = None) -> Path:
    """A copy of checkpoint ``path`` without tensor ``name`` (or with ``instead`` in its place)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    if instead is not None:
        tensors[name] = instead
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("layout", "name"), [
    ("block", "model.layers.0.self_attn.k_proj.weight_scale_inv"),
    ("ct_channel", "model.layers.1.mlp.up_proj.weight_scale"),
    ("ct_tensor_static", "model.layers.0.mlp.down_proj.input_scale"),
])
def test_a_missing_scale_is_named(layout: str, name: str, fp8_checkpoints, tmp_path) -> None:
    path, _ = fp8_checkpoints("qwen3", layout)
    cut = without(path, tmp_path / "cut", name)
    with pytest.raises(UnsupportedModelError, match=f"checkpoint tensor {name} is missing"):
        load_model(cut, ModelSpec.from_dir(cut), torch.float32, CPU)


@pytest.mark.parametrize(("layout", "block", "name", "scale", "says"), [
    # q/k/v cut 128-row blocks here, so the fused projection is held in the model dtype: its scales
    # are read to dequantize and were taken whatever their shape (scores off by 0.2)
    ("block", (128, 128), "model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(2, 2), r"\(2, 2\), expected \(1, 1\)"),
    ("block", (128, 128), "model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(64, 1), r"\(64, 1\), expected \(1, 1\)"),
    ("ct_channel", (16, 16), "model.layers.0.self_attn.k_proj.weight_scale", torch.ones(3, 1), r"\(3, 1\), expected \(64,\)"),
    ("block", (128, 128), "model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(1, 1, dtype=torch.uint8),
     "is U8: byte-sized"),
])
def test_a_scale_of_another_shape_or_dtype_is_refused_by_name(layout, block, name, scale, says, fp8_checkpoints,
                                                             tmp_path) -> None:
    path, _ = fp8_checkpoints("qwen3", layout, block)
    bad = without(path, tmp_path / "bad", name, scale)
    with pytest.raises(UnsupportedModelError, match=f"checkpoint tensor {re.escape(name)} (has shape )?{says}"):
        load_model(bad, ModelSpec.from_dir(bad), torch.float32, CPU)


@pytest.mark.parametrize("layout", ["block", "ct_channel"])
def test_an_fp8_weights_nan_code_is_refused_by_name(layout: str, fp8_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file

    path, _ = fp8_checkpoints("qwen3", layout)
    name = "model.layers.0.mlp.gate_proj.weight"
    w = load_file(str(path / "model.safetensors"))[name].clone()
    w.view(torch.uint8)[1, 2] = 0xFF  # e4m3fn's NaN (-NaN)
    bad = without(path, tmp_path / "bad", name, w)
    with pytest.raises(ValueError, match=f"holds NaN or infinite values in: {re.escape(name)}"):
        load_model(bad, ModelSpec.from_dir(bad), torch.float32, CPU)


def test_latent_attention_blocks_that_cut_a_heads_rotated_rows_are_refused(fp8_checkpoints) -> None:
    """DeepSeek's rotated rows load permuted (interleaved to halves): a block scale stays right
    only when each head's rotated rows lie in one block (16 rows at 32-47 of each 48: 8-row
    blocks cut them and scored off by 0.05-0.08; 16-row ones hold them)."""
    path, _ = fp8_checkpoints("deepseek_v3", "block", (8, 16))
    with pytest.raises(UnsupportedModelError, match="8-row weight blocks of the FP8 checkpoint cut a head's 16 rotated"):
        load_model(path, ModelSpec.from_dir(path), torch.float32, CPU)


def test_experts_whose_intermediate_size_cuts_the_blocks_are_refused_naming_it(fp8_checkpoints) -> None:
    """At one GPU no smaller tensor-parallel size helps: the message says what does not fit."""
    moe, _ = fp8_checkpoints("qwen3moe", "block", (64, 16))
    with pytest.raises(UnsupportedModelError, match="experts' intermediate size 32 is not whole blocks"):
        load_model(moe, ModelSpec.from_dir(moe), torch.float32, CPU, load_format="dummy")


def test_a_tensor_parallel_shard_that_cuts_a_scale_block_is_refused(fp8_checkpoints) -> None:
    """Scale blocks must not straddle two ranks (a row-parallel layer's input columns, the
    experts' intermediate rows): refused when the model is built, naming the slice."""
    path, _ = fp8_checkpoints("qwen3", "block", (16, 48))
    spec = ModelSpec.from_dir(path)
    load_model(path, spec, torch.float32, CPU)  # tp 1: the column blocks end the axis (64 = 48 + 16)
    with pytest.raises(UnsupportedModelError, match=r"input columns: columns \[0, 64\) of 128 are not whole "
                                                    r"48-column blocks of the fp8 weight format"):
        load_model(path, spec, torch.float32, CPU, load_format="dummy", tp=TensorParallel(2, 0))
    moe, _ = fp8_checkpoints("qwen3moe", "block", (32, 16))
    with pytest.raises(UnsupportedModelError, match=r"expert gate/up rows: rows \[0, 16\) of 32 are not whole 32-row"):
        load_model(moe, ModelSpec.from_dir(moe), torch.float32, CPU, load_format="dummy", tp=TensorParallel(2, 0))


def test_dummy_fp8_weights_score(fp8_checkpoints) -> None:
    """--load-format dummy with an FP8 config.json (the benchmarks' FP8 models): e4m3 weights
    and scales drawn in place, scored."""
    path, _ = fp8_checkpoints("qwen3moe", "block")
    eng = Engine(Config(model=str(path), load_format="dummy", device="cpu", max_num_batched_tokens=32, block_size=8,
                        num_kv_blocks=64, max_model_len=256))
    (res,) = eng.run_to_completion(make_requests(family_rng("qwen3moe"))[4:5])
    assert res.error is None and np.isfinite(res.token_id_logprobs).all()


BASE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8}
FP8_WEIGHTS = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}


def ct(fmt: str = "float-quantized", weights: dict | None = None, acts: dict | None = None, **more: object) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, **more,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights or FP8_WEIGHTS,
                                          "input_activations": acts}}}


@pytest.mark.parametrize(("config", "says"), [
    (ct("pack-quantized", {"type": "int", "num_bits": 4, "strategy": "group"}), "format 'pack-quantized' (INT4"),
    (ct("int-quantized", {"type": "int", "num_bits": 8, "strategy": "channel"}), "'int-quantized' (INT8 weights)"),
    (ct("nvfp4-pack-quantized", {"type": "float", "num_bits": 4}), "'nvfp4-pack-quantized' (NVFP4 weights)"),
    (ct(weights={**FP8_WEIGHTS, "num_bits": 4}), "compressed-tensors with 4-bit float weights"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme (an FP8 KV cache)"),
    ({**ct(), "config_groups": {"g": {"targets": ["Linear"], "weights": FP8_WEIGHTS, "output_activations": {
        "type": "float", "num_bits": 8}}}}, "quantized output activations"),
    (ct(acts={"type": "float", "num_bits": 8, "dynamic": False, "strategy": "token"}),
     "static input activations with strategy 'token'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "block-wise weights and activation_scheme static"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e4m3"}, "scale_fmt 'e4m3'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_cache_scheme": {"num_bits": 8}},
     "quant_method fp8 with kv_cache_scheme (an FP8 KV cache)"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128] is not two positive integers"),
    ({"quant_method": "fbgemm_fp8"}, "quant_method 'fbgemm_fp8' (FP8 weights with per-row scales)"),
    # malformed rather than unbuilt: named (they failed as an AttributeError or "unhashable type")
    (ct(sparsity_config="dense"), "quantization_config's sparsity_config is 'dense': an object is needed"),
    ({**ct(), "config_groups": {"group_0": "FP8_DYNAMIC"}}, "config_groups.group_0 is 'FP8_DYNAMIC': an object"),
    ({"quant_method": ["fp8"]}, "quant_method is ['fp8']: a method's name is needed"),
])
def test_what_is_not_built_is_refused_by_name(config: dict, says: str) -> None:
    with pytest.raises(UnsupportedModelError, match=re.escape(says)):
        ModelSpec.from_dict({**BASE, "quantization_config": config})


def test_deepseek_v3_1s_power_of_two_scales_load_as_float_scales(fp8_checkpoints, tmp_path) -> None:
    """DeepSeek-V3.1 declares ``scale_fmt: ue8m0`` (its block scales are powers of two, stored in
    float32 as V3's): read as any float scales, the checkpoint scores as it does without the key."""
    import shutil

    path, _ = fp8_checkpoints("deepseek_v3", "block")
    v31 = tmp_path / "v31"
    shutil.copytree(path, v31)
    cfg = json.loads((v31 / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (v31 / "config.json").write_text(json.dumps(cfg))
    reqs = requests("deepseek_v3")
    for got, want in zip(engine(v31).run_to_completion(reqs), engine(path).run_to_completion(reqs)):
        assert got.error is None and np.array_equal(got.token_id_logprobs, want.token_id_logprobs)


def test_the_published_configs_are_read() -> None:
    """Qwen3-8B-FP8's quantization_config, a compressed-tensors FP8-dynamic one and a
    compressed-tensors FP8 block one (llm-compressor's FP8_BLOCK) are built."""
    from teacher_server.layers.formats import make_format

    qwen = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    dyn = ct(acts={"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token", "symmetric": True},
             ignore=["lm_head"], quantization_status="compressed")
    blk = ct(weights={**FP8_WEIGHTS, "strategy": "block", "block_structure": [128, 128]},
             acts={"type": "float", "num_bits": 8, "dynamic": True, "strategy": "group", "group_size": 128})
    for config, scheme in ((qwen, ("block", (128, 128), "dynamic")), (dyn, ("channel", (128, 128), "dynamic")),
                           (blk, ("block", (128, 128), "dynamic"))):
        spec = ModelSpec.from_dict({**BASE, "quantization_config": config})
        fmt = make_format(spec.weight_format, spec.quantization_config)
        assert (fmt.scheme.weights, fmt.scheme.block, fmt.scheme.activations) == scheme


def test_quantization_fp8_is_a_setting_and_refuses_a_quantized_checkpoint() -> None:
    """--quantization fp8 (vLLM's flag, and -q), TEACHER_SERVER_QUANTIZATION and the file's
    quantization field; it quantizes a bf16 checkpoint at load and refuses an FP8 one."""
    args = vars(build_parser().parse_args(["serve", "m", "-q", "fp8"]))
    assert args["quantization"] == "fp8"
    assert Config.load(env={"TEACHER_SERVER_QUANTIZATION": "fp8"}).quantization == "fp8"
    assert Config.load(env={}).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--quantization", "awq"])
    plain = ModelSpec.from_dict(BASE)
    assert plain.with_quantization(None) is plain
    assert plain.with_quantization("fp8").weight_format == "fp8_online"
    fp8 = ModelSpec.from_dict({**BASE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 8]}})
    with pytest.raises(UnsupportedModelError, match="quantized already \\(quant_method 'fp8'\\)"):
        fp8.with_quantization("fp8")


def test_the_accuracy_benchmark_runs_tiny(tmp_path) -> None:
    """bench/fp8_accuracy.py at a tiny size on the CPU (FP8 products emulated): both FP8
    variants are close to their dequantized float32 forwards and to the bf16 model, not equal."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "acc.json"
    subprocess.run([sys.executable, str(root / "bench" / "fp8_accuracy.py"), "--tiny", "--requests", "2", "--rows",
                    "16", "--dir", str(tmp_path / "ckpt"), "--out", str(out)], check=True, cwd=root,
                   capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    for variant in ("block", "online"):
        err = result["vs_dequantized"][variant]
        assert 0 < err["mean_abs"] <= err["max_abs"] < 0.2, err
        assert 0 < result["kl_bf16_fp8"][variant] < 0.01, result["kl_bf16_fp8"]


def test_a_fused_projection_with_bf16_parts_is_held_in_the_model_dtype(fp8_checkpoints, monkeypatch) -> None:
    """Qwen3.5-27B-FP8's layout, as on a GPU: the linear layers' in-projection (FP8 q/k/v and
    z beside bf16 b and a) is held in the model dtype with its FP8 parts dequantized as read;
    every other projection stays FP8."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    path, twin = fp8_checkpoints("qwen3_5", "block", (16, 16), QWEN3_5_IGNORE)
    model = load_model(path, ModelSpec.from_dir(path), torch.float32, CPU)
    ref = load_model(twin, ModelSpec.from_dir(twin), torch.float32, CPU)
    for i in (0, 2):  # the linear layers
        mixer, want = model.layers[i].linear_attn, ref.layers[i].linear_attn
        assert mixer.in_proj.fmt is UNQUANTIZED and isinstance(mixer.o_proj.fmt, Fp8Weights)
        torch.testing.assert_close(mixer.in_proj.weight, want.in_proj.weight, rtol=0, atol=0)
    attn = model.layers[1].self_attn
    assert isinstance(attn.qkv_proj.fmt, Fp8Weights) and attn.qkv_proj.weight.dtype == ops.FP8


@pytest.mark.parametrize(("runs", "want"), [({"block", "row"}, "block"), ({"row"}, "row"), (set(), None)])
def test_a_layer_takes_the_first_multiply_that_runs_here(runs: set[str], want: str | None, fp8_checkpoints,
                                                         monkeypatch) -> None:
    """Block where the block multiply runs at the layer's shape, else row (its block scales
    requantized per row), else the weights dequantized (a GPU without the multiply)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    monkeypatch.setattr(fp8_format, "product_runs", lambda mode, k, n, experts, device: mode in runs)
    path, _ = fp8_checkpoints("qwen3hd128", "block", (128, 128))
    model = load_model(path, ModelSpec.from_dir(path), torch.float32, CPU)
    o = model.layers[0].self_attn.o_proj
    if want is None:
        assert o.fmt is UNQUANTIZED and o.weight.dtype == torch.float32
    else:
        assert o.fmt.mode(o) == want and o.weight.dtype == ops.FP8
        assert o.weight_scale_inv.shape == ((o.weight.shape[0], 1) if want == "row" else (2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "layout", "block", "mode"), [
    ("qwen3hd128", "block", (128, 128), "block"),  # torch's block-wise scaled multiply (sm90)
    ("moe128", "block", (128, 128), "block"),  # the grouped block kernel for experts
    # row-wise experts (gathered codes and row scales; one static scale), their SiLU-mul pass's
    # input, and the norm pass after each expert layer quantizing the next q/k/v input
    ("moe128", "ct_channel", (128, 128), "row"),
    ("moe128", "fp8_tensor_static", (128, 128), "row"),
    ("qwen3hd128", "ct_channel", (128, 128), "row"),
    ("qwen3hd128", "ct_block", (128, 128), "block"),
    ("qwen3hd128", "fp8_tensor_static", (128, 128), "row"),  # static per-tensor activations
    ("qwen3hd128", "online", (128, 128), "row"),
])
def test_gpu_fp8_scores_as_transformers_fp8_path(family: str, layout: str, block: tuple[int, int], mode: str,
                                                 fp8_checkpoints, monkeypatch) -> None:
    """On the GPU: the layers multiply in FP8 in the mode expected, and the scores' mean abs
    error against the float32 forward of the dequantized weights is no larger than that of the
    same FP8 arithmetic done exactly (this engine's FP8 products through ops.fp8's plain-torch
    definitions, float32 on the CPU) plus bf16's own (transformers' bf16 forward of the same
    weights). (The distance to that exact FP8 forward is printed, not bounded: bf16 activations
    move some values across an e4m3 rounding step, and through the layers the two forwards'
    roundings decorrelate, so it is about the FP8 error itself; one product's exactness is
    test_fp8_ops's.) Where transformers' own FP8 path runs (it fetches its kernels from the
    hub), the error is also no larger than its."""
    import transformers as tf
    from reference import errors_vs_reference

    path, twin = fp8_checkpoints(family, layout, block)
    quant = "fp8" if layout == "online" else None
    eng = Engine(Config(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=64, block_size=16,
                        num_kv_blocks=512, max_model_len=2048, quantization=quant))
    held = [m for m in eng.model.modules() if isinstance(getattr(m, "fmt", None), Fp8Weights)]
    assert held and {m.fmt.mode(m) for m in held} == {mode}
    reqs = requests(family)
    results = eng.run_to_completion(reqs)
    theirs = tf.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16).cuda().eval()
    ours, bf16 = errors_vs_reference(twin, reqs, results, theirs)
    ours_mae, bf16_mae = float(np.concatenate(ours).mean()), float(np.concatenate(bf16).mean())
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)  # the exact FP8 arithmetic, on the CPU
    exact = engine(path, quantization=quant).run_to_completion(reqs)
    exact_err, apart = [], []
    for q, r, x in zip(reqs, results, exact):
        if q.rows:
            ref = reference_scores(twin, q.token_ids.tolist(), q.candidates, q.start)
            fin = np.isfinite(ref)
            exact_err.append(np.abs(x.token_id_logprobs[fin] - ref[fin]))
            apart.append(np.abs(r.token_id_logprobs[fin] - x.token_id_logprobs[fin]))
    exact_mae, apart_mae = float(np.concatenate(exact_err).mean()), float(np.concatenate(apart).mean())
    line = (f"{family} {layout}: FP8 mean abs error {ours_mae:.5f}, max {float(np.concatenate(ours).max()):.4f}; "
            f"exact FP8 arithmetic {exact_mae:.5f}; ours from it {apart_mae:.5f}; transformers bf16 of the same "
            f"weights {bf16_mae:.5f}")
    if layout == "block":
        try:
            fp8_tf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
            tf_mae = float(np.concatenate(errors_vs_reference(twin, reqs, results, fp8_tf)[1]).mean())
        except (ImportError, RuntimeError, ValueError) as e:  # no accelerate, no kernels (a hub download), ...
            line += f"; transformers' FP8 path did not run: {str(e)[:120]}"
        else:
            line += f"; transformers' FP8 path {tf_mae:.5f}"
            assert ours_mae <= 1.1 * tf_mae, (ours_mae, tf_mae)
    print(line)
    assert ours_mae <= exact_mae + bf16_mae, line


def test_the_down_projection_input_quantized_in_the_silu_mul_pass_is_the_same(fp8_checkpoints,
                                                                               monkeypatch) -> None:
    """A dense MLP's FP8 down projection takes silu(gate) * up quantized in the SiLU-mul pass
    (``silu_mul_input``): the same product as quantizing the activation in a pass of its own,
    also for a slice of its rows (a row-parallel product in parts)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    for layout, block in (("block", (128, 128)), ("ct_tensor_static", (16, 16)), ("ct_channel", (16, 16))):
        path, _ = fp8_checkpoints("qwen3hd128", layout, block)
        down = load_model(path, ModelSpec.from_dir(path), torch.float32, CPU).layers[0].mlp.down_proj
        gate_up = torch.randn(40, 2 * down.weight.shape[1], generator=torch.Generator().manual_seed(1))
        fused = down.fmt.silu_mul_input(down, gate_up)
        plain = ops.silu_mul_reference(gate_up)
        torch.testing.assert_close(down.fmt.apply(down, fused), down.fmt.apply(down, plain), rtol=0, atol=0)
        torch.testing.assert_close(down.fmt.apply(down, fused[8:24]), down.fmt.apply(down, plain[8:24]), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("method", ["silu_mul_input", "gather_input"])
@pytest.mark.parametrize(("family", "layout", "block"), [
    ("moe128", "block", (128, 128)), ("qwen3moe", "block", (16, 16)), ("qwen3moe", "ct_tensor_static", (16, 16)),
    ("deepseek_v3", "block", (16, 16)),
])
def test_the_experts_fp8_inputs_made_in_fewer_passes_score_the_same(method: str, family: str, layout: str,
                                                                    block: tuple[int, int], fp8_checkpoints,
                                                                    monkeypatch) -> None:
    """FP8 experts (row-wise, 1 x 128 groups, a static input scale) take their inputs made in
    fewer passes: ``silu_mul_input(.., "down")``, silu(gate) * up quantized in the SiLU-mul pass
    as the down product's input (DeepSeek's ungated shared experts too); ``gather_input``, the
    layer's T input rows quantized, then the (token, slot) rows' codes and scales gathered
    instead of T * k gathered bf16 rows quantized. Every expert layer takes them, and the scores
    are the same bits as with a quantizing pass of its own (a row's codes depend on that row
    alone)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    path, _ = fp8_checkpoints(family, layout, block)
    reqs = requests(family)
    on = engine(path)
    experts = [m for m in on.model.modules() if getattr(m, "role", None) == "experts"]
    assert experts and all(isinstance(m.fmt, Fp8Weights) for m in experts)
    seen = []
    made = getattr(Fp8Weights, method)
    monkeypatch.setattr(Fp8Weights, method, lambda self, layer, *a: seen.append(layer) or made(self, layer, *a))
    got = on.run_to_completion(reqs)
    assert {id(m) for m in experts} <= {id(m) for m in seen}
    monkeypatch.setattr(Fp8Weights, method, lambda *a: None)
    want = engine(path).run_to_completion(reqs)
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        np.testing.assert_array_equal(g.token_id_logprobs, w.token_id_logprobs)


def same_with_the_norm_pass_off(path: Path, reqs: list, got: list, calls: list, **settings: object) -> None:
    """The scores ``got`` equal those of an engine quantizing the normed rows in a pass of their
    own (FusedOps.fp8_norm_input off), which makes none of the spied-on ``calls``."""
    off = engine(path, **settings)
    off.runner.ops.fp8_norm_input = False
    calls.clear()
    want = off.run_to_completion(reqs)
    assert not calls
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        np.testing.assert_allclose(g.token_id_logprobs, w.token_id_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("family", "layout", "block"), [
    ("qwen3hd128", "block", (128, 128)), ("qwen3", "ct_tensor_static", (16, 16)), ("qwen3", "online", (16, 16)),
])
def test_projection_inputs_quantized_in_the_norm_pass_score_the_same(family: str, layout: str, block: tuple[int, int],
                                                                      fp8_checkpoints, monkeypatch) -> None:
    """The q/k/v and gate/up projections of FP8 dense layers take the RMSNorm's rows quantized
    in the norm's pass (``norm_input``: the first layer's gate/up, every later layer's q/k/v
    too): each such input made there, and the scores equal those with the norm and then a
    quantizing pass of its own (FusedOps.fp8_norm_input off); the model's last norm (the LM
    head's rows) stays plain."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    calls = []
    for name in ("rms_norm_quant", "add_rms_norm_quant"):
        f = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=f, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    path, _ = fp8_checkpoints(family, layout, block)
    reqs = requests(family)
    on = engine(path, quantization="fp8" if layout == "online" else None)
    layers = on.model.layers
    assert len(layers) > 1 and layers[-1].next_reader is None  # the final norm's rows go to the LM head
    assert all(a.next_reader is b.self_attn.qkv_proj for a, b in zip(layers, layers[1:]))
    calls.clear()
    got = on.run_to_completion(reqs)
    # per step: each layer's gate/up input, and the q/k/v input of every layer past the first
    # (the last layer's MLP runs only in steps with rows for the LM head)
    assert len(calls) >= 2 * len(layers) - 1, calls
    same_with_the_norm_pass_off(path, reqs, got, calls, quantization="fp8" if layout == "online" else None)


def test_fp8_residual_adds_are_made_in_the_norm_pass(fp8_checkpoints, monkeypatch) -> None:
    """With the residual add in the GEMM epilogue on (the CUDA default), an FP8 o/down product,
    whose scaled multiply has no such epilogue, goes to the next norm's pass as its delta
    (``add_rms_norm_quant``: x + delta read once) rather than being added in a pass of its own
    that the norm then reads again; the scores are those of the plain add."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    calls = []
    for name in ("rms_norm_quant", "add_rms_norm_quant"):
        f = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _f=f, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    path, _ = fp8_checkpoints("qwen3hd128", "block", (128, 128))
    reqs = requests("qwen3hd128")
    want = engine(path).run_to_completion(reqs)
    eng = engine(path)
    eng.tuning = replace(eng.tuning, residual_in_gemm=True)
    calls.clear()
    got = eng.run_to_completion(reqs)
    assert calls and set(calls) == {"add_rms_norm_quant"}, sorted(set(calls))
    for g, w in zip(got, want):
        assert g.error is None and w.error is None
        np.testing.assert_allclose(g.token_id_logprobs, w.token_id_logprobs, rtol=0, atol=1e-6)


def test_an_expert_layers_sum_is_quantized_for_the_next_q_k_v_in_the_norm_pass(fp8_checkpoints, monkeypatch) -> None:
    """After an expert layer the residual add, the next layer's input norm and its q/k/v input's
    quantization are one pass (``add_norm`` with the next layer's reader), as after a dense
    MLP: every layer past the first gets its q/k/v input there, and the scores equal those with
    the quantization in a pass of its own."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    path, _ = fp8_checkpoints("qwen3moe", "block", (16, 16))
    reqs = requests("qwen3moe")
    on = engine(path)
    layers = on.model.layers
    sparse = [a for a in layers[:-1] if a.sparse]
    assert sparse and all(a.next_reader is b.self_attn.qkv_proj for a, b in zip(layers, layers[1:]))
    calls = []
    f = ops.add_rms_norm_quant
    monkeypatch.setattr(ops, "add_rms_norm_quant", lambda x, d, w, *a, **kw: calls.append(id(w)) or f(x, d, w, *a, **kw))
    got = on.run_to_completion(reqs)
    assert {id(a.next_norm.weight) for a in sparse} <= set(calls)  # the norm after each expert layer
    same_with_the_norm_pass_off(path, reqs, got, calls)


def test_an_expert_layers_quantization_kernels_are_checked_at_both_input_widths(fp8_checkpoints, monkeypatch) -> None:
    """The activation quantization kernels of an FP8 expert layer are checked at start-up at the
    width of each slot's input: H for gate/up, and I for down, whose input the SiLU-mul pass
    quantizes (a kernel unchecked at I would run unchecked)."""
    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    widths = []
    monkeypatch.setattr(fp8_format, "quant_kernels_ok", lambda k, device, dtype: widths.append(k) or True)
    path, _ = fp8_checkpoints("qwen3moe", "block", (16, 16))
    eng = engine(path)
    experts = [m for m in eng.model.modules() if getattr(m, "role", None) == "experts"]
    assert experts
    for m in experts:
        assert {m.gate_up.shape[-1], m.down.shape[-1]} <= set(widths) and m.fp8_kernel


@pytest.mark.parametrize(("fast", "checks", "want"), [(True, True, True), (False, True, False), (True, False, False)])
def test_row_wise_products_accumulate_fast_where_set_and_checked(fast: bool, checks: bool, want: bool,
                                                                fp8_checkpoints, monkeypatch) -> None:
    """``fp8_fast_accum`` (on by default): the linear layers' row-wise products and the experts'
    down product ask for Hopper's fast FP8 accumulation where its start-up check at their widths
    passes; ``--no-fp8-fast-accum``, or a check that fails, leaves them promoted (the experts'
    down product then the Triton kernel's)."""
    from teacher_server.layers.formats import fp8_dispatch

    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    real_runs = fp8_dispatch.product_runs
    monkeypatch.setattr(fp8_dispatch, "product_runs", lambda *a, fast_accum=False: (
        checks or not fast_accum) and real_runs(*a, fast_accum=fast_accum))
    asked = []
    real = ops.scaled_linear
    monkeypatch.setattr(ops, "scaled_linear", lambda *a, fast_accum=False, **kw: asked.append(fast_accum) or real(
        *a, fast_accum=fast_accum, **kw))
    _, twin = fp8_checkpoints("moe256", "block", (128, 128))
    eng = engine(twin, quantization="fp8", fp8_fast_accum=fast)
    held = [m for m in eng.model.modules() if isinstance(getattr(m, "fmt", None), Fp8Weights)]
    linear = [m for m in held if m.role != "experts"]
    assert linear and all(m.fp8_mode == "row" and m.fp8_fast_accum == want for m in linear)
    experts = [m for m in held if m.role == "experts"]
    assert experts and all(m.fp8_fast_down == want for m in experts)
    got = eng.run_to_completion(requests("moe128"))
    assert all(r.error is None for r in got)
    assert asked and set(asked) == {want}


def test_every_rank_reads_the_spec_with_the_configured_quantization_and_accumulation(fp8_checkpoints) -> None:
    """The engine's process and each tensor-parallel worker build the spec by one function
    (``rank_setup.model_spec``): ``--quantization fp8`` and ``--no-fp8-fast-accum`` reach all."""
    from teacher_server.engine.rank_setup import model_spec

    _, twin = fp8_checkpoints("moe256", "block", (128, 128))
    for fast in (True, False):
        spec = model_spec(Config(model=str(twin), quantization="fp8", fp8_fast_accum=fast), twin)
        assert spec.weight_format == "fp8_online" and spec.fp8_fast_accum is fast
    assert model_spec(Config(model=str(twin)), twin).weight_format == "unquantized"
