"""GPU checks of the engine pieces: attention backends against each other and the CPU
reference (causal with a cached prefix: queries shorter than keys), and the bf16 path
against transformers (DESIGN.md: mean abs error no larger than transformers' own bf16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from teacher_server.model.attention import SdpaBackend, make_backend
from teacher_server.model.context import StepContext

pytestmark = pytest.mark.gpu


def ctx_for(q_lens: list[int], k_lens: list[int], dev: str) -> StepContext:
    cu_q = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + np.cumsum(k_lens).tolist(), dtype=torch.int32, device=dev)
    z = torch.zeros(0, dtype=torch.int64, device=dev)
    return StepContext(z, z, cu_q, cu_k, max(q_lens), max(k_lens), q_lens, k_lens, None, None, None, None, None,
                       sum(k_lens), z)


@pytest.mark.parametrize("backend", ["varlen", "flash_attn"])
@pytest.mark.parametrize("window", [None, 64])
def test_backend_matches_reference(backend: str, window) -> None:  # noqa: ANN001
    try:
        attn = make_backend(backend, torch.device("cuda"))
    except Exception as e:  # flash-attn is optional (the Docker image has it)
        pytest.skip(f"{backend} unavailable: {e}")
    torch.manual_seed(0)
    q_lens = [1, 7, 300, 128, 1000]
    k_lens = [1, 50, 300, 1000, 1000]  # prefix of k - q tokens precedes the queries
    hq, hk, d = 8, 2, 128
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(k_lens), hk, d, device="cuda", dtype=torch.bfloat16)
    c = ctx_for(q_lens, k_lens, "cuda")
    got = attn(q, k, v, c, d ** -0.5, window).float()
    ref = SdpaBackend()(q.float().cpu(), k.float().cpu(), v.float().cpu(), ctx_for(q_lens, k_lens, "cpu"),
                        d ** -0.5, window)
    err = (got.cpu() - ref).abs().max().item()
    assert err < 2e-2, err  # bf16 inputs and outputs


def test_dense_cudnn_path_matches_reference() -> None:
    """All sequences of one length, no prefix: the varlen backend takes cuDNN's dense path."""
    attn = make_backend("varlen", torch.device("cuda"))
    torch.manual_seed(1)
    q_lens = [512] * 4
    hq, hk, d = 8, 2, 128
    q = torch.randn(2048, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2048, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2048, hk, d, device="cuda", dtype=torch.bfloat16)
    got = attn(q, k, v, ctx_for(q_lens, q_lens, "cuda"), d ** -0.5, None).float().cpu()
    assert attn.dense_cudnn, "cuDNN dense path was not taken"
    ref = SdpaBackend()(q.float().cpu(), k.float().cpu(), v.float().cpu(), ctx_for(q_lens, q_lens, "cpu"),
                        d ** -0.5, None)
    assert (got - ref).abs().max().item() < 2e-2
    attn.dense_cudnn = False
    varlen = attn(q, k, v, ctx_for(q_lens, q_lens, "cuda"), d ** -0.5, None).float().cpu()
    assert (varlen - ref).abs().max().item() < 2e-2
