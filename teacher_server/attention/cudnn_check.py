"""The cuDNN backend's start-up self-check: one small mixed step through every cuDNN path,
against the float32 sdpa reference, for each setting variant until one agrees (the step and
its reference are the cudnn_fe backend's check too: ``cudnn_fe_check.frontend_check``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.cudnn import CudnnBackend
from teacher_server.attention.cudnn_items import Fresh, Group, Prefixed
from teacher_server.attention.packed import cums
from teacher_server.attention.sdpa import SdpaBackend
from teacher_server.step_context import StepContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudnnPaths:
    """The cuDNN settings that passed the self-check (constructor arguments of the backend)."""

    native_gqa: bool
    group_prefixes: bool


# Native GQA before expanded kv heads; prefix groups on, then off (a group path that fails
# costs the groups only, not cuDNN).
_VARIANTS = (CudnnPaths(True, True), CudnnPaths(True, False), CudnnPaths(False, True), CudnnPaths(False, False))
CHECK_HEADS = (4, 2, 128)  # the start-up checks' query heads, kv heads and head dim


def _check_step(device: torch.device, dtype: torch.dtype, heads: tuple[int, ...] = CHECK_HEADS,
                ) -> tuple[AttentionInputs, Callable[[torch.device], StepContext]]:
    """Prefixed sequences with and without a prefix split, two sharing a prefix, fresh ones
    at and off a bucket length, short ones; every shape fit for cuDNN. heads: (query heads,
    kv heads, head dim[, value width]); values as wide as the keys unless given."""
    g = torch.Generator(device="cpu").manual_seed(0)
    # (q, k): prefixed first; the last two prefixed share their first 800 keys (a group)
    lens = [(320, 900), (260, 300), (300, 1100), (280, 1100), (512, 512), (300, 300), (40, 40)]
    q_lens, k_lens, npf = [a for a, _ in lens], [b for _, b in lens], 4
    shared = [0, 0, 0, 800]
    hq, hk, d, dv = (*heads, heads[2])[:4]
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, w, generator=g).to(device, dtype) for h, w in ((hq, d), (hk, d), (hk, dv)))
    kp, vp = (torch.randn(sum(k_lens[:npf]), hk, w, generator=g).to(device, dtype) for w in (d, dv))
    qo = ko = 0
    for i, (lq, lk) in enumerate(lens[:npf]):  # each prefixed sequence's own keys end its packed keys
        kp[ko + lk - lq:ko + lk] = k[qo:qo + lq]
        vp[ko + lk - lq:ko + lk] = v[qo:qo + lq]
        if shared[i]:
            pk = ko - k_lens[i - 1]
            kp[ko:ko + shared[i]] = kp[pk:pk + shared[i]]
            vp[ko:ko + shared[i]] = vp[pk:pk + shared[i]]
        qo, ko = qo + lq, ko + lk

    def ctx_on(dev: torch.device) -> StepContext:
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        cq = torch.tensor(cums(q_lens), dtype=torch.int32, device=dev)
        ck = torch.tensor(cums(k_lens), dtype=torch.int32, device=dev)
        return StepContext(input_ids=z, positions=z, cu_q=cq, cu_k=ck, max_q=max(q_lens), max_k=max(k_lens),
                           q_lens=q_lens, k_lens=k_lens, write_src=None, write_slots=None, new_pos=None,
                           prefix_pos=None, prefix_slots=None, total_k=sum(k_lens[:npf]), logits_idx=z,
                           n_prefixed=npf, tok_prefixed=sum(q_lens[:npf]), prefix_shared=shared)

    return AttentionInputs(q, k, v, kp, vp), ctx_on


def check_with_reference(device: torch.device, dtype: torch.dtype, heads: tuple[int, ...] = CHECK_HEADS,
                          ) -> tuple[AttentionInputs, Callable[[torch.device], StepContext], torch.Tensor]:
    """The check step (``_check_step``) and its float32 sdpa reference output on the CPU."""
    x, ctx_on = _check_step(device, dtype, heads)
    cpu = torch.device("cpu")
    ref_in = AttentionInputs(*(t.float().to(cpu) for t in (x.q, x.k, x.v, x.kp, x.vp)))
    return x, ctx_on, SdpaBackend()(ref_in, ctx_on(cpu), x.q.shape[-1] ** -0.5, None)


def self_check(make: Callable[..., CudnnBackend], device: torch.device, dtype: torch.dtype) -> CudnnPaths | None:
    """Run the check step through backends made by ``make(native_gqa=, group_prefixes=,
    new_plans_per_step=None)`` and through the float32 sdpa reference; return the first
    settings whose backend agrees and took every cuDNN path, or None (cuDNN unusable)."""
    x, ctx_on, ref = check_with_reference(device, dtype)
    d = x.q.shape[-1]
    for paths in _VARIANTS:
        backend = make(native_gqa=paths.native_gqa, group_prefixes=paths.group_prefixes, new_plans_per_step=None)
        try:
            c = ctx_on(device)
            got = backend(x, c, d ** -0.5, None).float().cpu()
        except Exception as e:
            log.info("cuDNN attention self-check (native GQA %s, groups %s) raised: %s", paths.native_gqa,
                     paths.group_prefixes, e)
            continue
        kinds = {type(it) for it in c.attn_plan.items}
        took = backend.enabled and {Fresh, Prefixed} | ({Group} if paths.group_prefixes else set()) <= kinds
        err = (got - ref).abs().max().item()
        if took and err < 2e-2:
            if not paths.group_prefixes:
                log.warning("cuDNN attention: prefix groups failed the self-check; each prefixed sequence runs alone")
            return paths
        log.info("cuDNN attention self-check (native GQA %s, groups %s): error %.3g, cuDNN paths used %s",
                 paths.native_gqa, paths.group_prefixes, err, sorted(t.__name__ for t in kinds))
    log.warning("cuDNN attention failed its self-check; using varlen")
    return None
