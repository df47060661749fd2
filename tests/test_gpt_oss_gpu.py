"""gpt-oss and Qwen3-Next on the GPU. Attention sinks on each fast backend that takes them (the
log-sum-exp path of torch varlen and flash-attn) against the float32 sdpa reference, windows
of 128 and prefixed chunks included; the cuDNN backends refuse sinks. gpt-oss at its head width
(64) and window (128): float32 within 1e-3 of transformers' float32, and in bf16 on each
backend no larger mean error against the float32 reference than transformers' own bf16
forward; Qwen3-Next at head widths of 128 in bf16 likewise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attn_util import make_step
from family_gpu import bf16_mean_errors, engine, engine_or_skip
from oss_ref import make_gpt_oss_checkpoint, make_qwen3_next_checkpoint
from reference import errors_vs_reference
from test_parity import check, long_requests, make_requests

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.registry import make_backend
from teacher_server.attention.sdpa import SdpaBackend
from teacher_server.cache_layout import AttentionParams

pytestmark = pytest.mark.gpu
SINK_BACKENDS = ("flash_attn", "varlen")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("oss_gpu")
    return {"gpt_oss": make_gpt_oss_checkpoint("plain", root / "gpt_oss", gpu=True),
            "qwen3_next": make_qwen3_next_checkpoint(root / "qwen3_next", gpu=True)}


@pytest.mark.parametrize("backend", SINK_BACKENDS)
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_each_backend(backend: str, window: int | None) -> None:
    """Fresh and prefixed sequences (GQA 8:2, head width 64): the backend's output with sinks
    equals sdpa's float32 softmax with the sink column, to bf16 rounding."""
    dev = torch.device("cuda")
    try:
        b = make_backend(backend, dev, torch.bfloat16, needs=(AttentionParams(0.125, window, sinks=True),))
    except (ValueError, RuntimeError, ImportError) as e:
        pytest.skip(f"{backend} takes no sinks here: {e}")
    x, ctx, _ = make_step([(300, 300), (97, 97), (200, 700), (64, 400)], 8, 2, 64, "cuda", torch.bfloat16)
    sinks = torch.randn(8, device=dev)
    got = b(AttentionInputs(x.q, x.k, x.v, x.kp, x.vp, sinks), ctx, 0.125, window).float().cpu()
    cpu = AttentionInputs(*(None if t is None else t.float().cpu() for t in (x.q, x.k, x.v, x.kp, x.vp)),
                          sinks.cpu())
    from attn_util import step_context

    c = step_context(ctx.cu_q.cpu(), ctx.cu_k.cpu(), ctx.q_lens, ctx.k_lens, ctx.n_prefixed)
    ref = SdpaBackend()(cpu, c, 0.125, window)
    err = (got - ref).abs()
    print(f"{backend} window {window}: sinks max abs err {err.max():.4f}, mean {err.mean():.5f}")
    assert err.max() < 3e-2 and err.mean() < 2e-3, (float(err.max()), float(err.mean()))


@pytest.mark.parametrize("backend", ["cudnn_fe", "cudnn"])
def test_cudnn_backends_refuse_sinks(backend: str) -> None:
    with pytest.raises((ValueError, RuntimeError, ImportError)):
        make_backend(backend, torch.device("cuda"), torch.bfloat16, needs=(AttentionParams(0.125, sinks=True),))


def test_gpt_oss_parity_gpu_float32(paths) -> None:
    """Within the contract's 1e-3 of transformers' float32 on the CPU; transformers' own float32
    forward on this GPU is printed beside ours (how far the GPU's float32 alone moves them)."""
    import transformers as tf

    torch.backends.cuda.matmul.allow_tf32 = False
    path = paths["gpt_oss"]
    reqs = make_requests(np.random.default_rng(7)) + long_requests(np.random.default_rng(5))
    results = engine(path, "float32", budget=256).run_to_completion(reqs)
    theirs = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ours_err, tf_err = errors_vs_reference(path, reqs, results, theirs)
    print(f"gpt-oss float32 on the GPU against transformers' float32 on the CPU: ours max "
          f"{max(float(e.max()) for e in ours_err):.2e}, transformers' own GPU forward max "
          f"{max(float(e.max()) for e in tf_err):.2e}")
    check(path, reqs, results, tol=1e-3)


@pytest.mark.parametrize(("family", "backend"), [("gpt_oss", "auto"), ("gpt_oss", "varlen"),
                                                 ("gpt_oss", "flash_attn"), ("qwen3_next", "auto")])
def test_parity_gpu_bfloat16(family: str, backend: str, paths) -> None:
    """bf16 weights vs the float32 reference: our mean abs error is no larger than transformers'
    own bf16 forward's on the same weights (sequences past the window, chunks, prefix hits)."""
    path = paths[family]
    eng = engine_or_skip(path, "bfloat16", backend)
    ours_mae, theirs_mae = bf16_mean_errors(path, eng)
    print(f"{family} on {eng.tuning.attention.name}: bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, "
          f"transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae, (ours_mae, theirs_mae)
