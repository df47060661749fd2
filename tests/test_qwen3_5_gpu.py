"""Qwen3.5 on the GPU (fla-core's Gated DeltaNet kernels when installed): bf16 weights against
the float32 reference, our mean abs error no larger than transformers' own bf16 forward on the
same weights (which uses the same fla kernels); float32 close to the reference; a GRPO group
served from the prefix cache (state snapshots through the kernels' initial and final states)."""
# (transformers' forward on the GPU is not under ``torch_reference_kernels``: it runs fla-core.)

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import errors_vs_reference, reference_scores
from test_parity import long_requests, make_requests

from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest

pytestmark = pytest.mark.gpu

VOCAB = 512


def grpo_group(rng: np.random.Generator, prompt_len: int = 600, n: int = 4) -> list[ScoreRequest]:
    """One prompt long enough for several chunks at a 256-token budget, n responses."""
    prompt = rng.integers(0, VOCAB, prompt_len)
    return [ScoreRequest(f"G{j}", np.concatenate([prompt, rng.integers(0, VOCAB, 150 + 40 * j)]), prompt_len - 1,
                         rng.choice(VOCAB, 16, replace=False), max_tokens=1) for j in range(n)]


@pytest.mark.parametrize("family", ["qwen3_5_hd128", "qwen3_5_moe_hd128"])
def test_qwen3_5_parity_gpu_bfloat16(family: str, checkpoints) -> None:
    """Short requests (varlen attention, many tiny linear-layer sequences), long ones (cuDNN
    attention, chunked at 256 tokens: the state crosses chunk boundaries in the kernels) and a
    GRPO group whose siblings start from the prompt's snapshot: ours within transformers' bf16
    error of the float32 reference."""
    import transformers as tf

    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=256,
                        block_size=16, num_kv_blocks=512, max_model_len=2048))
    reqs = make_requests(np.random.default_rng(11)) + long_requests(np.random.default_rng(5))
    group = grpo_group(np.random.default_rng(3))
    results = eng.run_to_completion(reqs) + eng.run_to_completion(group[:1]) + eng.run_to_completion(group[1:])
    reqs = reqs + group
    assert [r.cached_tokens for r in results[-3:]] == [592] * 3  # (600 - 1) // 16 * 16
    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    ours_mae, theirs_mae = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    print(f"{family}: bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae, (ours_mae, theirs_mae)


@pytest.mark.parametrize("family", ["qwen3_5_hd128", "qwen3_5_moe_hd128"])
def test_qwen3_5_parity_gpu_float32(family: str, checkpoints) -> None:
    """float32 weights, chunked at 32 tokens: our worst cell error against the CPU float32
    reference within transformers' own float32 forward on the GPU plus 1e-3, or within a
    per-family floor. fla's Triton kernels take float32 dot products in TF32 on both sides, and
    the worst cell moves from run to run with the configs its autotuner picks: on H200s the MoE
    family gave ours 0.0513 and 0.0534, transformers' 0.0375 in the latter run; the dense
    family stays under 1e-2. Floors: 0.1 for the MoE family, 0.02 for the dense one. A state
    lost across chunks is off by nats: 4.9-6.4 worst on these requests on the CPU, with the
    recurrent or the convolution states of every chunk but the first dropped."""
    import transformers as tf

    torch.backends.cuda.matmul.allow_tf32 = False
    path = checkpoints[family]
    eng = Engine(Config(model=str(path), device="cuda", dtype="float32", max_num_batched_tokens=32,
                        block_size=8, num_kv_blocks=256, max_model_len=512))
    reqs = make_requests(np.random.default_rng(7))
    results = eng.run_to_completion(reqs)
    hf32 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for q, r in zip(reqs, results):
        if q.rows and r.error is None:  # -inf exactly where the reference has it
            ref = reference_scores(path, q.token_ids.tolist(), q.candidates, q.start)
            np.testing.assert_array_equal(np.isfinite(r.token_id_logprobs), np.isfinite(ref))
    errs = errors_vs_reference(path, reqs, results, hf32)
    ours, theirs = (max((float(e.max()) for e in side if e.size), default=0.0) for side in errs)
    print(f"{family}: float32 worst abs error vs CPU reference: ours {ours:.5f}, transformers on GPU {theirs:.5f}")
    floor = {"qwen3_5_hd128": 0.02, "qwen3_5_moe_hd128": 0.1}[family]
    assert ours <= max(theirs + 1e-3, floor), (ours, theirs)
