"""What an FP8 checkpoint's ``quantization_config`` says, read into one ``Fp8Scheme`` (no
torch: the spec refuses what is not built before anything is loaded).

Two writers, one storage: e4m3 weights with float32 scales that multiply.

- ``quant_method: fp8`` (transformers' fine-grained FP8: Qwen's and DeepSeek's FP8 releases):
  ``weight_block_size`` [r, c] gives one scale per r x c block (``weight_scale_inv``, or
  ``weight_scale`` as some exporters spell it); without it one scale per tensor.
  ``activation_scheme`` dynamic, or static with a per-tensor ``input_scale`` (per-tensor
  weights only). ``modules_to_not_convert`` / ``ignored_layers`` list what the checkpoint keeps
  in bf16.
- ``quant_method: compressed-tensors`` (llm-compressor), ``format`` float-quantized or
  naive-quantized: one config group of 8-bit float weights, strategy ``channel`` ([out, 1]
  ``weight_scale``), ``tensor`` ([1]) or ``block`` (``block_structure``); input activations
  dynamic (per token, per tensor or in 1 x 128 groups), static per tensor (``input_scale``), or
  none (weight-only). ``ignore`` lists what stays in bf16 (names or ``re:`` patterns).

Which layers are FP8 is read from the checkpoint's tensors themselves when it is loaded (their
dtype, a scale beside each), so the ignore lists hold however they are spelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from teacher_server.unsupported import UnsupportedModelError


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint stores its weights and scales its activations."""

    weights: str  # "block" (one scale per block), "channel" (per output row) or "tensor"
    block: tuple[int, int] = (128, 128)  # rows x columns of a scale's block ("block" only)
    activations: str = "dynamic"  # "dynamic", "static" (a per-tensor input_scale) or "none" (weight-only)
    scale_name: str = "weight_scale_inv"  # the checkpoint's usual spelling (named in errors)
    serialized: bool = True  # False: a bf16 checkpoint quantized at load (per row)


def scale_shape(weight: tuple[int, ...], scheme: Fp8Scheme) -> tuple[int, ...]:
    """The scales of ``weight`` [..., N, K] as a layer holds them: one per block
    ([..., ceil(N / r), ceil(K / c)]), else one per row ([..., N, 1])."""
    *lead, n, k = weight
    (r, c) = scheme.block
    return (*lead, -(-n // r), -(-k // c)) if scheme.weights == "block" else (*lead, n, 1)


E4M3 = "F8_E4M3"  # safetensors' dtype name
SPELLINGS = ("weight_scale_inv", "weight_scale")  # a weight's scales, as checkpoints name them
FLOAT_SCALES = ("F32", "BF16", "F16", "F64")  # safetensors' dtypes a scale may be stored in


def weight_scale(weight: str, tensors: dict[str, Any], scheme: Fp8Scheme) -> str | None:
    """The checkpoint's scale tensor of ``weight`` (``tensors``: name -> its dtype and shape),
    None where it has none, refused by name where it cannot be read: under both spellings, a
    byte-sized dtype, missing beside an e4m3 weight, or a shape not its scheme's."""
    prefix = weight.removesuffix("weight")
    scales = [prefix + s for s in SPELLINGS if prefix + s in tensors]
    if len(scales) > 1:
        raise UnsupportedModelError(f"checkpoint tensors {scales[0]} and {scales[1]} are both scales of {weight}: "
                                    f"a weight's scales are one tensor, under either name")
    if scales and tensors[scales[0]].dtype not in FLOAT_SCALES:
        raise UnsupportedModelError(f"checkpoint tensor {scales[0]} is {tensors[scales[0]].dtype}: byte-sized (e8m0) "
                                    f"scale tensors are not supported; float scales are")
    if tensors[weight].dtype == E4M3:
        if not scales:
            raise UnsupportedModelError(f"checkpoint tensor {prefix}{scheme.scale_name or SPELLINGS[0]} is missing: "
                                        f"{weight} is FP8 and needs its scales")
        check_scale_shape(scales[0], tensors[scales[0]].shape, tensors[weight].shape, scheme)
    return scales[0] if scales else None


def check_scale_shape(name: str, scale: tuple[int, ...], weight: tuple[int, ...], scheme: Fp8Scheme) -> None:
    """Refuse a scale tensor whose shape is not its scheme's for ``weight`` [..., N, K]: one per
    block, else one per tensor or per row ([..., N] or [..., N, 1])."""
    *lead, n, _ = weight
    if scheme.weights == "block":
        want = [scale_shape(tuple(weight), scheme)]
    else:
        want = [(*lead, n), (*lead, n, 1), (1,), ()] + ([(*lead, 1, 1), (*lead, 1), (*lead,)] if lead else [])
    if tuple(scale) not in want:
        raise UnsupportedModelError(f"checkpoint tensor {name} has shape {tuple(scale)}, expected {want[0]}")


# quantized at load (``--quantization fp8``): per-row weights, per-token dynamic activations
AT_LOAD = Fp8Scheme("channel", scale_name="", serialized=False)


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported; FP8 e4m3 weights (block-wise, per channel or per tensor "
                                 f"scales) with dynamic or static per-tensor activations are")


def fp8_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """The scheme of a ``quant_method: fp8`` quantization_config."""
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(f"quant_method fp8 with fmt {fmt!r}")
    # ue8m0 (DeepSeek-V3.1): scales that are powers of two, stored as float32 as any others
    # (byte-sized scale tensors are refused by dtype at load: ``Fp8Weights.plan_load``)
    if config.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise _refuse(f"quant_method fp8 with scale_fmt {config['scale_fmt']!r}")
    if config.get("kv_cache_scheme"):
        raise _refuse("quant_method fp8 with kv_cache_scheme (an FP8 KV cache)")
    if config.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(f"quant_method fp8 with expert_dtype {config['expert_dtype']!r}")
    acts = str(config.get("activation_scheme", "dynamic")).lower()
    if acts not in ("dynamic", "static"):
        raise _refuse(f"quant_method fp8 with activation_scheme {acts!r}")
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", activations=acts)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(f"quant_method fp8: weight_block_size {block!r} is not two positive integers")
    if acts == "static":
        raise _refuse("quant_method fp8 with block-wise weights and activation_scheme static")
    return Fp8Scheme("block", (int(block[0]), int(block[1])))


# compressed-tensors formats that are not 8-bit float weights, by what they hold
_CT_OTHER = {
    "pack-quantized": "INT4/INT8 packed weights", "int-quantized": "INT8 weights",
    "nvfp4-pack-quantized": "NVFP4 weights", "mxfp4-pack-quantized": "MXFP4 weights",
    "marlin-24": "2:4 sparse INT4 weights", "mixed-precision": "mixed-precision weights",
}


def compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """The scheme of a ``quant_method: compressed-tensors`` quantization_config (FP8 only)."""
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    bad = next((f"config_groups.{k} is {v!r:.60}" for k, v in groups.items() if not isinstance(v, dict)), None)
    if bad is None and not isinstance(config.get("sparsity_config") or {}, dict):
        bad = f"sparsity_config is {config['sparsity_config']!r:.60}"
    if bad is not None:  # (an object with its keys is needed; read as one, it failed as an AttributeError)
        raise UnsupportedModelError(f"compressed-tensors quantization_config's {bad}: an object is needed")
    schemes = [(g.get("format") or config.get("format"), g.get("weights"), g.get("input_activations"))
               for g in groups.values()]
    if any(g.get("output_activations") for g in groups.values()):
        raise _refuse("compressed-tensors with quantized output activations")
    if any(s != schemes[0] for s in schemes):
        raise _refuse("compressed-tensors with config groups of different schemes")
    fmt, weights, acts = schemes[0]
    if fmt in _CT_OTHER:
        raise _refuse(f"compressed-tensors format {fmt!r} ({_CT_OTHER[fmt]})")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}")
    if config.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (an FP8 KV cache)")
    if (config.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise _refuse("compressed-tensors sparsity_config")
    if not isinstance(weights, dict) or weights.get("type") != "float" or weights.get("num_bits") != 8:
        what = f"{weights.get('num_bits')}-bit {weights.get('type')}" if isinstance(weights, dict) else "no"
        raise _refuse(f"compressed-tensors with {what} weights")
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise _refuse("compressed-tensors with dynamic or asymmetric weight scales")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise _refuse(f"compressed-tensors FP8 weights with strategy {strategy!r}")
    block = (128, 128)
    if strategy == "block":
        shape = weights.get("block_structure")
        if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(isinstance(b, int) and b > 0
                                                                               for b in shape)):
            raise UnsupportedModelError(f"compressed-tensors: block_structure {shape!r} is not two positive integers")
        block = (int(shape[0]), int(shape[1]))
    if acts is None:
        return Fp8Scheme(strategy, block, "none", "weight_scale")
    if not isinstance(acts, dict) or acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise _refuse("compressed-tensors with input activations other than 8-bit float")
    if acts.get("dynamic"):  # scales made at run time: quantized this server's way (docs/fp8.md), whatever the
        return Fp8Scheme(strategy, block, "dynamic", "weight_scale")  # checkpoint names (strategy, groups, zero points)
    if acts.get("strategy") != "tensor" or strategy == "block":
        raise _refuse(f"compressed-tensors static input activations with strategy {acts.get('strategy')!r} "
                      f"and {strategy} weights")
    return Fp8Scheme(strategy, block, "static", "weight_scale")
