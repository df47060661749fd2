"""Models whose layers mix global and sliding-window attention (the first layer global):
every attention backend against transformers in float32. A backend plans a step once per
window, so a windowed layer never runs on the plan a global layer made (the cuDNN backends
route whole sequences to their own calls, which take no window).

On the CPU: the sdpa backend and the cuDNN backends' plans with their device calls replaced
by float32 math (``attn_util.CpuCudnn``, the ``fe_backend`` fixture); on the GPU: every GPU
backend, in bf16, against transformers' own bf16 error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from attn_util import CpuCudnn
from reference import errors_vs_reference
from test_attention_plan import fe_backend  # noqa: F401  (the fixture)
from test_parity import check, long_requests, make_requests

from teacher_server.cache_layout import FULL, SLIDING
from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest


def engine(path, **kw: object) -> Engine:
    return Engine(Config(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=8, num_kv_blocks=256,
                         max_model_len=512, **kw))


@pytest.mark.parametrize("family,kinds", [("qwen2mixed", [FULL, SLIDING, SLIDING, SLIDING]),
                                          ("qwen3mixed", [FULL, SLIDING, FULL, SLIDING])])
def test_the_model_declares_each_layers_window(family: str, kinds: list[str], checkpoints) -> None:
    eng = engine(checkpoints[family])
    layout = eng.runner.kv.layout
    assert [c.kind for c in layout.attention] == kinds
    assert {c.params.window for c in layout.attention if c.kind == SLIDING} == {12}
    assert len(layout.params()) == 2


@pytest.mark.parametrize("family", ["qwen2mixed", "qwen3mixed"])
@pytest.mark.parametrize("backend", ["sdpa", "cudnn", "cudnn_fe"])
def test_mixed_windows_match_transformers(family: str, backend: str, checkpoints, fe_backend) -> None:  # noqa: F811
    """Chunked sequences (a 32-token budget), prefix-cache hits and windows of 12 keys: each
    layer sees exactly its keys. The cuDNN stand-ins take sequences from 8 queries on, so
    fresh sequences run on their whole-sequence calls in the global layers."""
    path = checkpoints[family]
    eng = engine(path)
    if backend != "sdpa":
        cudnn = CpuCudnn(8)
        eng.tuning = dataclasses.replace(eng.tuning, attention=cudnn if backend == "cudnn" else fe_backend(split=cudnn))
    reqs = make_requests(np.random.default_rng(3))
    check(path, reqs, eng.run_to_completion(reqs))
    # a second pass over the same prompts reads the cached prefixes (prefixed sequences)
    again = [ScoreRequest(q.request_id + "b", q.token_ids, q.start, q.candidates, max_tokens=1) for q in reqs]
    check(path, again, eng.run_to_completion(again))
    if backend == "cudnn":  # the global layers took cuDNN's whole-sequence calls, the windowed ones varlen
        kinds = {type(it).__name__ for _, items in cudnn.plans for it in items}
        assert {"Fresh", "Varlen"} <= kinds, kinds


def test_a_backend_that_cannot_honour_a_layer_is_refused_at_start_up(checkpoints, monkeypatch) -> None:
    """A named backend that takes no window is refused when the model has windowed layers
    (and tuning may not switch a windowed model to it); a model without windows runs on it;
    ``auto`` passes over such a backend to the next that can."""
    from teacher_server.attention import registry
    from teacher_server.attention.sdpa import SdpaBackend
    from teacher_server.cache_layout import AttentionParams

    class NoWindow(SdpaBackend):
        honours = frozenset()

    real_sdpa = registry.BACKENDS["sdpa"]
    monkeypatch.setitem(registry.BACKENDS, "sdpa", lambda *a: NoWindow())
    with pytest.raises(ValueError, match="takes no sliding window"):
        engine(checkpoints["qwen3mixed"], attention_backend="sdpa")
    eng = engine(checkpoints["qwen3"], attention_backend="sdpa")  # no window: it serves
    monkeypatch.setitem(registry.BACKENDS, "sdpa", real_sdpa)
    mixed = engine(checkpoints["qwen3mixed"], attention_backend="sdpa")
    with pytest.raises(ValueError, match="takes no sliding window"):
        mixed.tuning = dataclasses.replace(mixed.tuning, attention=eng.attn)

    class Capped(SdpaBackend):  # honours windows, not soft-caps
        honours = frozenset({"window"})

    for name in registry._AUTO_ORDER:  # stand-ins: the first takes no window, the second no soft-cap
        monkeypatch.setitem(registry.BACKENDS, name, lambda *a, n=name: {"cudnn_fe": NoWindow(), "cudnn": Capped()}
                            .get(n) or (_ for _ in ()).throw(RuntimeError("not here")))
    cuda = torch.device("cuda")
    assert type(registry.make_backend("auto", cuda, needs=[AttentionParams(0.1, 8)])) is Capped
    assert type(registry.make_backend("auto", cuda, needs=[AttentionParams(0.1)])) is NoWindow
    assert type(registry.make_backend("auto", cuda, needs=[AttentionParams(0.1, 8, 30.0)])) is SdpaBackend


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "cudnn", "cudnn_fe", "flash_attn"])
def test_mixed_windows_on_the_gpu_backends(backend: str, checkpoints) -> None:
    """bf16 against the float32 reference, no worse than transformers' own bf16 forward, with
    sequences long enough for the cuDNN paths (a window of 300 keys across 512-token chunks)."""
    import transformers as tf

    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    if backend == "cudnn_fe":
        pytest.importorskip("cudnn")
    path = checkpoints["qwen3mixed_hd128"]
    eng = Engine(Config(model=str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=512, block_size=16,
                        num_kv_blocks=512, max_model_len=2048, attention_backend=backend))
    assert eng.attn.name == backend
    reqs = long_requests(np.random.default_rng(5))
    results = eng.run_to_completion(reqs)
    hf16 = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ours, theirs = errors_vs_reference(path, reqs, results, hf16)
    ours_mae, theirs_mae = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    print(f"mixed windows ({backend}): bf16 mean abs error vs fp32 reference: ours {ours_mae:.5f}, "
          f"transformers bf16 {theirs_mae:.5f}")
    assert ours_mae <= theirs_mae * 1.1, (ours_mae, theirs_mae)


def test_a_sliding_layer_gathers_only_its_window_of_a_cached_prefix(checkpoints, monkeypatch) -> None:
    """Prefix-cache hits longer than the window (12): each sliding layer gathers at most 11
    cached keys per prefixed sequence (those its first query sees), each global layer the
    whole prefix, and the scores equal those of a run that gathers every key in every layer."""
    from teacher_server.kv_pool import KVPool

    path = checkpoints["qwen3mixed"]
    reqs = make_requests(np.random.default_rng(5))
    again = [ScoreRequest(q.request_id + "b", q.token_ids, q.start, q.candidates, max_tokens=1) for q in reqs]
    real = KVPool.gather_prefixed
    seen: list[tuple[int, int, int]] = []  # (layer, prefix keys gathered, prefixed sequences)

    def spy(self, layer, k, v, ctx):
        seen.append((layer, ctx.prefix_slots.numel(), ctx.n_prefixed))
        return real(self, layer, k, v, ctx)

    monkeypatch.setattr(KVPool, "gather_prefixed", spy)
    out = {}
    for trimmed in (True, False):
        eng = engine(path)
        if not trimmed:
            eng.runner.windows = ()
        eng.run_to_completion(reqs)
        seen.clear()
        out[trimmed] = eng.run_to_completion(again)
        if trimmed:
            check(path, again, out[True])
            sliding = [n for layer, n, b in seen if layer % 2 == 1]
            full = [n for layer, n, b in seen if layer % 2 == 0]
            assert all(n <= 11 * b for layer, n, b in seen if layer % 2 == 1)
            assert sum(full) > 2 * sum(sliding) > 0, (sum(full), sum(sliding))
    for a, b in zip(out[True], out[False]):
        np.testing.assert_allclose(a.token_id_logprobs, b.token_id_logprobs, rtol=0, atol=1e-5)
