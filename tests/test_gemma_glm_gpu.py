"""Gemma 3 and GLM-4.5 on the GPU at head dim 128: float32 within 1e-3 of transformers'
float32; in bf16 on every fast attention backend that loads here (Gemma's windowed layers of
300 keys and its global layers each on the backend's own path, sequences chunked at a
512-token budget and prefixed continuations), a mean error against the float32 reference no
larger than transformers' own bf16 forward's (10 % slack, as the mixed-window test); GLM on the
default backend and torch varlen."""

from __future__ import annotations

import pytest
from family_gpu import bf16_mean_errors, check_float32, engine_or_skip
from family_helpers import lazy_checkpoints
from gemma_glm_ref import make_gemma3_checkpoint, make_glm_checkpoint

pytestmark = pytest.mark.gpu
BACKENDS = ("cudnn_fe", "cudnn", "flash_attn", "varlen")
# Gemma on every backend (its windows take each backend's windowed path); GLM's attention is plain
# grouped-query attention: the default backend and torch varlen
CASES = [("gemma3_hd128", b) for b in BACKENDS] + [("glm_hd128", "cudnn_fe"), ("glm_hd128", "varlen")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    def make(name, path):
        return (make_gemma3_checkpoint if name.startswith("gemma") else make_glm_checkpoint)(name, path)

    return lazy_checkpoints(tmp_path_factory.mktemp("gemma_glm_gpu"), make)


@pytest.mark.parametrize("name", ["gemma3_hd128", "glm_hd128"])
def test_parity_gpu_float32(name: str, ckpt) -> None:
    check_float32(ckpt[name])


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_parity_gpu_bfloat16_each_backend(name: str, backend: str, ckpt) -> None:
    """bf16 weights vs the float32 reference, beside transformers' own bf16 forward."""
    path = ckpt[name]
    eng = engine_or_skip(path, "bfloat16", backend)
    assert eng.attn.name == backend
    ours_mae, theirs_mae = bf16_mean_errors(path, eng)
    print(f"{name} {backend}: bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, "
          f"transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae * 1.1, (ours_mae, theirs_mae)
