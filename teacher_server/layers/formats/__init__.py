"""Weight formats (``base.WeightFormat``), one file per format, and the registry from
config.json's ``quantization_config`` to the format a model's layers are built with:

- absent (or empty): ``unquantized`` (the weights in the model dtype);
- a ``quant_method`` registered here: that format, made by its factory from the whole
  ``quantization_config`` (block sizes, ignored modules, ...);
- a method known but not built (``NOT_BUILT``): refused by name, as is an unknown one;
- ``fp8_online``: no checkpoint says it; ``ModelSpec.with_quantization`` picks it for a bf16
  checkpoint served with ``--quantization fp8`` (quantized at load).

A registered method may also check its config when the spec is read (``CHECKS``: what it
does not build is refused then, by name, before anything is loaded).

A new format is one file in this package and a ``register_format`` entry here (its factory
imports the file on first use: reading a config.json needs no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from teacher_server.unsupported import UnsupportedModelError

if TYPE_CHECKING:
    from teacher_server.layers.formats.base import WeightFormat

# A factory makes the format from config.json's quantization_config ({} when unquantized).
Factory = Callable[[dict[str, Any]], "WeightFormat"]
FORMATS: dict[str, Factory] = {}

# quant_method values of Hugging Face checkpoints whose formats are not built: refused with
# what they are.
NOT_BUILT: dict[str, str] = {
    "fbgemm_fp8": "FP8 weights with per-row scales",
    "gptq": "GPTQ integer weights",
    "awq": "AWQ integer weights",
    "bitsandbytes": "bitsandbytes 8-bit / 4-bit weights",
    "modelopt": "ModelOpt FP8 / NVFP4 weights",
    "gguf": "GGUF quantized weights",
    "hqq": "HQQ integer weights",
    "aqlm": "AQLM codebook weights",
    "eetq": "EETQ INT8 weights",
    "torchao": "torchao quantized weights",
    "quark": "Quark quantized weights",
    "bitnet": "BitNet ternary weights",
}


def register_format(method: str) -> Callable[[Factory], Factory]:
    """Register the factory of the format config.json names ``quant_method: <method>``."""
    def add(factory: Factory) -> Factory:
        FORMATS[method] = factory
        return factory

    return add


@register_format("unquantized")
def _unquantized(config: dict[str, Any]) -> WeightFormat:
    from teacher_server.layers.formats.unquantized import UNQUANTIZED

    return UNQUANTIZED


@register_format("fp8")
def _fp8(config: dict[str, Any]) -> WeightFormat:
    from teacher_server.layers.formats.fp8 import Fp8Weights
    from teacher_server.layers.formats.fp8_config import fp8_scheme

    return Fp8Weights("fp8", fp8_scheme(config))


@register_format("compressed-tensors")
def _compressed_tensors(config: dict[str, Any]) -> WeightFormat:
    from teacher_server.layers.formats.fp8 import Fp8Weights
    from teacher_server.layers.formats.fp8_config import compressed_tensors_scheme

    return Fp8Weights("compressed-tensors", compressed_tensors_scheme(config))


@register_format("fp8_online")
def _fp8_online(config: dict[str, Any]) -> WeightFormat:
    from teacher_server.layers.formats.fp8 import Fp8Weights
    from teacher_server.layers.formats.fp8_config import AT_LOAD

    return Fp8Weights("fp8_online", AT_LOAD)


def _check_fp8(config: dict[str, Any]) -> None:
    from teacher_server.layers.formats.fp8_config import fp8_scheme

    fp8_scheme(config)


def _check_compressed_tensors(config: dict[str, Any]) -> None:
    from teacher_server.layers.formats.fp8_config import compressed_tensors_scheme

    compressed_tensors_scheme(config)


# quant_method -> a check of its quantization_config (UnsupportedModelError: what is not built)
CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {"fp8": _check_fp8,
                                                        "compressed-tensors": _check_compressed_tensors}
# registered formats no checkpoint's quant_method selects (a setting does: --quantization)
FLAG_ONLY = ("fp8_online",)


def format_name(quantization_config: Any) -> str:
    """The registered format of config.json's ``quantization_config``; UnsupportedModelError
    naming its ``quant_method`` where none is registered."""
    if not quantization_config:
        return "unquantized"
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
    if not isinstance(method, str | None):  # (a list is no registered name: it failed as unhashable)
        raise UnsupportedModelError(f"quantization_config's quant_method is {method!r:.60}: a method's name is needed")
    if method in FORMATS and method not in FLAG_ONLY:
        if method in CHECKS:
            CHECKS[method](quantization_config)
        return method
    built = ", ".join(m for m in FORMATS if m not in FLAG_ONLY)
    what = f" ({NOT_BUILT[method]})" if method in NOT_BUILT else " (an unknown method)"
    raise UnsupportedModelError(f"quantized checkpoints with quant_method {method!r}{what} are not supported; "
                                f"weight formats built: {built}")


def make_format(name: str, quantization_config: dict[str, Any]) -> WeightFormat:
    """The format registered as ``name`` (``format_name``'s answer), made from the config."""
    return FORMATS[name](quantization_config)


@register_format("mxfp4")
def _mxfp4(config: dict[str, Any]) -> WeightFormat:
    from teacher_server.layers.formats.mxfp4 import Mxfp4

    return Mxfp4()  # gpt-oss's experts, dequantized at load
