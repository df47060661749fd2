"""A registry of attention backend creators, each importing its backend on first use
(flash-attn and torch's varlen op are optional), and ``make_backend`` choosing among them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from teacher_server.attention.base import AttentionBackend
from teacher_server.cache_layout import AttentionParams

log = logging.getLogger(__name__)

# A creator builds its backend for (device, dtype, deterministic) or raises when it cannot.
Creator = Callable[[torch.device, torch.dtype, bool], AttentionBackend]
BACKENDS: dict[str, Creator] = {}


def register(name: str) -> Callable[[Creator], Creator]:
    def add(fn: Creator) -> Creator:
        BACKENDS[name] = fn
        return fn

    return add


def _needs_cuda(name: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")


@register("sdpa")
def _sdpa(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend:
    from teacher_server.attention.sdpa import SdpaBackend

    return SdpaBackend()


@register("varlen")
def _varlen(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend:
    _needs_cuda("varlen", device)
    from teacher_server.attention.varlen import TorchVarlenBackend

    return TorchVarlenBackend()


@register("flash_attn")
def _flash_attn(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend:
    _needs_cuda("flash_attn", device)
    from teacher_server.attention.flash_attn import FlashAttnBackend

    return FlashAttnBackend()


def _checked_cudnn(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend | None:
    """The cudnn backend with the settings that passed its self-check, or None (cuDNN unusable)."""
    from teacher_server.attention.cudnn import CudnnBackend
    from teacher_server.attention.cudnn_check import self_check

    paths = self_check(CudnnBackend, device, dtype)
    if paths is None:
        return None
    # Deterministic mode: every shape builds its plan on first use, so a sequence's path
    # does not depend on what ran before.
    return CudnnBackend(new_plans_per_step=None if deterministic else 1, native_gqa=paths.native_gqa,
                        group_prefixes=paths.group_prefixes)


@register("cudnn")
def _cudnn(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend:
    _needs_cuda("cudnn", device)
    if not torch.backends.cudnn.is_available():
        raise RuntimeError("cuDNN is not available")
    backend = _checked_cudnn(device, dtype, deterministic)
    if backend is None:
        raise RuntimeError("cuDNN attention failed its self-check")
    return backend


@register("cudnn_fe")
def _cudnn_fe(device: torch.device, dtype: torch.dtype, deterministic: bool) -> AttentionBackend:
    _needs_cuda("cudnn_fe", device)
    from teacher_server.attention.cudnn_fe import CudnnFrontendBackend
    from teacher_server.attention.cudnn_fe_check import checked
    from teacher_server.attention.plan_store import store_from_env

    # its graphs read from the compile cache where a start before kept them (the checks run on them too)
    backend = CudnnFrontendBackend(split=_checked_cudnn(device, dtype, deterministic), plans=store_from_env(device))
    if not checked(backend, device, dtype):
        raise RuntimeError("cuDNN frontend attention failed its self-check")
    backend.check = checked
    return backend


_AUTO_ORDER = ("cudnn_fe", "cudnn", "flash_attn", "varlen")


def make_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 deterministic: bool = False, needs: Iterable[AttentionParams] = ()) -> AttentionBackend:
    """Build the named backend; ``auto`` picks cudnn_fe > cudnn > flash_attn > varlen on CUDA for
    bf16/fp16, sdpa on CPU and for float32 (the fused kernels take half precision only). A
    backend must honour ``needs``, the model's attention arguments (its ``refusal``): ``auto``
    passes over one that does not (sdpa honours them all); a named one is refused (ValueError)."""
    needs = tuple(needs)
    if name == "auto":
        if device.type == "cuda" and dtype != torch.float32:
            for cand in _AUTO_ORDER:
                try:
                    backend = BACKENDS[cand](device, dtype, deterministic)
                except Exception as e:  # missing package or op: try the next one
                    log.info("attention backend %s unavailable: %s", cand, e)
                    continue
                why = backend.refusal(needs)
                if why is None:
                    return backend
                log.info("%s; trying the next", why)
        return BACKENDS["sdpa"](device, dtype, deterministic)
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available (choose auto, {', '.join(BACKENDS)})")
    backend = BACKENDS[name](device, dtype, deterministic)
    why = backend.refusal(needs)
    if why is not None:
        raise ValueError(f"{why}: choose another attention backend (auto picks one that can)")
    return backend
