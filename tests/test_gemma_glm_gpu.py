"""Gemma 3 and GLM-4.5 on the GPU at head dim 128: float32 within 1e-3 of transformers'
float32; in bf16 on every fast attention backend that loads here (Gemma's windowed layers of
300 keys and its global layers each on the backend's own path, sequences chunked at a
512-token budget and prefixed continuations), a mean error against the float32 reference no
larger than transformers' own bf16 forward's (10 % slack, as the mixed-window test); GLM on the
default backend and torch varlen."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gemma_glm_ref import make_gemma3_checkpoint, make_glm_checkpoint
from reference import errors_vs_reference
from test_parity import check, long_requests, make_requests

from teacher_server.config import Config
from teacher_server.engine.engine import Engine

pytestmark = pytest.mark.gpu
BACKENDS = ("cudnn_fe", "cudnn", "flash_attn", "varlen")
# Gemma on every backend (its windows take each backend's windowed path); GLM's attention is plain
# grouped-query attention: the default backend and torch varlen
CASES = [("gemma3_hd128", b) for b in BACKENDS] + [("glm_hd128", "cudnn_fe"), ("glm_hd128", "varlen")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gemma_glm_gpu")

    class Lazy(dict):
        def __missing__(self, name: str):
            make = make_gemma3_checkpoint if name.startswith("gemma") else make_glm_checkpoint
            self[name] = make(name, root / name)
            return self[name]

    return Lazy()


def engine(path, dtype: str, backend: str = "auto", budget: int = 512) -> Engine:
    return Engine(Config(model=str(path), device="cuda", dtype=dtype, max_num_batched_tokens=budget, block_size=16,
                         num_kv_blocks=512, max_model_len=2048, attention_backend=backend))


@pytest.mark.parametrize("name", ["gemma3_hd128", "glm_hd128"])
def test_parity_gpu_float32(name: str, ckpt) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = ckpt[name]
    reqs = make_requests(np.random.default_rng(7))
    check(path, reqs, engine(path, "float32", budget=32).run_to_completion(reqs), tol=1e-3)


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_parity_gpu_bfloat16_each_backend(name: str, backend: str, ckpt) -> None:
    """bf16 weights vs the float32 reference, beside transformers' own bf16 forward."""
    import transformers as tf

    path = ckpt[name]
    try:
        eng = engine(path, "bfloat16", backend)
    except (ValueError, RuntimeError, ImportError) as e:
        pytest.skip(f"{backend} not available here: {e}")
    assert eng.attn.name == backend
    reqs = make_requests(np.random.default_rng(11)) + long_requests(np.random.default_rng(5))
    results = eng.run_to_completion(reqs)
    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    ours_mae, theirs_mae = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    print(f"{name} {backend}: bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, "
          f"transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae * 1.1, (ours_mae, theirs_mae)
