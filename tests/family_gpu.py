"""What the families' GPU tests share (``test_gemma_glm_gpu``, ``test_deepseek_gpu``,
``test_gpt_oss_gpu``): the engine they score with, float32 parity with transformers' float32,
and the bf16 comparison: the mean abs errors against the float32 reference of our bf16 scores
and of transformers' own bf16 forward on the same weights. ``device`` is the GPU in those tests
(the CPU where the helpers themselves are tried)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reference import errors_vs_reference
from test_parity import check, long_requests, make_requests

from teacher_server.config import Config
from teacher_server.engine.engine import Engine


def engine(path: Path, dtype: str, backend: str = "auto", budget: int = 512, device: str = "cuda") -> Engine:
    return Engine(Config(model=str(path), device=device, dtype=dtype, max_num_batched_tokens=budget, block_size=16,
                         num_kv_blocks=512, max_model_len=2048, attention_backend=backend))


def engine_or_skip(path: Path, dtype: str, backend: str, device: str = "cuda") -> Engine:
    """``engine``, or the test skipped where ``backend`` does not load here."""
    try:
        return engine(path, dtype, backend, device=device)
    except (ValueError, RuntimeError, ImportError) as e:
        pytest.skip(f"{backend} not available here: {e}")


def check_float32(path: Path, device: str = "cuda") -> None:
    """The parity requests scored in float32 (TF32 off) at a 32-token budget: within 1e-3 of
    transformers' float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reqs = make_requests(np.random.default_rng(7))
    check(path, reqs, engine(path, "float32", budget=32, device=device).run_to_completion(reqs), tol=1e-3)


def bf16_mean_errors(path: Path, eng: Engine, device: str = "cuda") -> tuple[float, float]:
    """(ours, transformers' bf16): the mean abs errors against the float32 reference of
    ``eng``'s scores and of transformers' own bf16 forward, over the parity requests and the long
    ones (chunked sequences and prefix hits)."""
    import transformers as tf

    reqs = make_requests(np.random.default_rng(11)) + long_requests(np.random.default_rng(5))
    results = eng.run_to_completion(reqs)
    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    return float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
