"""DeepSeek-V2/V3-class teachers on the GPU, at DeepSeek's head widths (q/k 192, v 128, latent
512 + 64): float32 within 1e-3 of transformers' float32; in bf16 on every fast attention backend
that loads here (values padded to the key width where the backend takes no narrower ones), no
larger mean error against the float32 reference than transformers' own bf16 forward; each
backend's answer to values narrower than keys, checked against sdpa where it takes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepseek_ref import make_deepseek_checkpoint
from family_gpu import bf16_mean_errors, check_float32, engine_or_skip
from family_helpers import lazy_checkpoints

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.registry import make_backend
from teacher_server.attention.sdpa import SdpaBackend
from teacher_server.step_context import StepContext

pytestmark = pytest.mark.gpu
BACKENDS = ("cudnn_fe", "cudnn", "flash_attn", "varlen")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return lazy_checkpoints(tmp_path_factory.mktemp("deepseek_gpu"),
                            lambda name, path: make_deepseek_checkpoint(name, path, mtp=False))


@pytest.mark.parametrize("name", ["v3_gpu", "v2lite_gpu"])
def test_parity_gpu_float32(name: str, ckpt) -> None:
    check_float32(ckpt[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_gpu_bfloat16_each_backend(backend: str, ckpt) -> None:
    """bf16 weights vs the float32 reference: our mean abs error is no larger than transformers'
    own bf16 forward's on the same weights (chunked sequences and prefix hits included)."""
    path = ckpt["v3_gpu"]
    eng = engine_or_skip(path, "bfloat16", backend)
    ours_mae, theirs_mae = bf16_mean_errors(path, eng)
    print(f"{backend} (v padded: {not eng.tuning.attention.distinct_v_width}): bf16 mean abs error vs fp32 "
          f"reference: ours {ours_mae:.5f}, transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae, (ours_mae, theirs_mae)


def one_step(lens: list[int], dev: torch.device) -> StepContext:
    """A step of fresh sequences of ``lens`` tokens (no prefix)."""
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=dev)
    t = int(cu[-1])
    return StepContext(input_ids=torch.zeros(t, dtype=torch.long, device=dev),
                       positions=torch.zeros(t, dtype=torch.long, device=dev), cu_q=cu, cu_k=cu, max_q=max(lens),
                       max_k=max(lens), q_lens=lens, k_lens=lens, logits_idx=torch.zeros(0, dtype=torch.long, device=dev))


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_narrower_than_keys(backend: str) -> None:
    """Each backend called with q/k 192 and v 128: a backend that declares it takes them
    (``distinct_v_width``) must match sdpa; the others are asked too and their answer printed
    (what a later change could switch on)."""
    dev = torch.device("cuda")
    try:
        b = make_backend(backend, dev, torch.bfloat16)
    except (ValueError, RuntimeError, ImportError) as e:
        pytest.skip(f"{backend} not available here: {e}")
    lens = [700, 301, 64]
    ctx = one_step(lens, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(sum(lens), 16, 192, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(sum(lens), 16, 128, device=dev, generator=g, dtype=torch.bfloat16)
    ref = SdpaBackend()(AttentionInputs(q, k, v), one_step(lens, dev), 192 ** -0.5, None).float()
    try:
        out = b(AttentionInputs(q, k, v), ctx, 192 ** -0.5, None)
        err = float((out.float() - ref).abs().max()) if out.shape == ref.shape else float("inf")
    except Exception as e:  # any refusal is an answer here
        out, err = None, f"{type(e).__name__}: {str(e)[:120]}"
    print(f"{backend}: v narrower than k -> {err} (declared {b.distinct_v_width})")
    if b.distinct_v_width:
        assert out is not None and err < 2e-2, err
    if b.takes_views:  # q and v where a Moonlight-shaped layer makes them: q inside q|latent rows, v inside kv_b's
        from teacher_server.attention.cudnn_fe_check import as_view

        x = AttentionInputs(as_view(q, (16 * 192 + 576, 192, 1)), k, as_view(v, (16 * 256, 256, 1)))
        out = b(x, one_step(lens, dev), 192 ** -0.5, None)
        err = float((out.float() - ref).abs().max())
        print(f"{backend}: q and v as strided views -> {err}")
        assert err < 2e-2, err
