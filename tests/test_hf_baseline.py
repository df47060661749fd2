"""The benchmark's transformers baseline computes the contract's matrix: run on CPU on a tiny
model in several left-padded batches, it matches the float32 reference request by request."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from reference import hf_model, reference_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import hf_baseline
from workloads import Req

VOCAB = 512  # the tiny checkpoints' vocabulary


def _requests(seed: int) -> list[Req]:
    """Mixed prompt and response lengths (left padding differs per row), unique ids per row,
    one -1 padded candidate."""
    rng = np.random.default_rng(seed)
    out = []
    for prompt, response in [(5, 9), (12, 3), (3, 20), (8, 8), (30, 1), (2, 14), (17, 11)]:
        toks = rng.integers(0, VOCAB, prompt + response)
        cand = np.stack([rng.choice(VOCAB, 6, replace=False) for _ in range(response)]).astype(np.int32)
        out.append(Req(toks, prompt - 1, cand))
    out[3].cand[2, -1] = -1
    return out


def test_batches_respect_the_budget() -> None:
    reqs = _requests(0)
    got = hf_baseline.batches(reqs, max_padded=64)
    assert sorted(i for b in got for i in b) == list(range(len(reqs)))
    lens = [[len(reqs[i].tokens) for i in b] for b in got]
    assert all(len(b) == 1 or len(b) * max(b) <= 64 for b in lens), lens
    assert [max(b) for b in lens] == sorted(max(b) for b in lens)  # length-sorted
    assert len(got) > 2


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3moe"])
def test_matches_the_float32_reference(checkpoints, family: str) -> None:
    path = checkpoints[family]
    reqs = _requests(1)
    seconds, results, finish = hf_baseline.run(hf_model(path), reqs, keep_results=True, max_padded=64)
    assert seconds > 0 and len(results) == len(finish) == len(reqs)
    assert all(0 < f <= seconds for f in finish)
    for r, got in zip(reqs, results):
        ref = reference_scores(path, r.tokens.tolist(), r.cand, r.start)
        assert got.shape == ref.shape == (r.rows, 6) and got.dtype == np.float32
        fin = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(got), fin)
        # batching with left padding changes the kernels' shapes, not the maths: float32 rounding
        np.testing.assert_allclose(got[fin], ref[fin], rtol=0, atol=1e-4)
    assert np.isneginf(results[3][2, -1])
    _, none, _ = hf_baseline.run(hf_model(path), reqs[:2], warmup=False)
    assert none == []


def test_packed_batches_respect_the_budget() -> None:
    reqs = _requests(2)
    got = hf_baseline.packed_batches(reqs, sep=3, max_tokens=48)
    assert sorted(i for b in got for i in b) == list(range(len(reqs)))
    sizes = [sum(len(reqs[i].tokens) + 3 for i in b) for b in got]
    assert all(len(b) == 1 or s <= 48 for b, s in zip(got, sizes)), sizes
    assert len(got) > 2


def segment_by_segment(torch_kernel):
    """A stand-in for fla-core's varlen kernel on the CPU: transformers' torch gated delta rule
    run on each ``cu_seqlens`` segment from a zero state."""
    import torch

    def kernel(query, key, value, g, beta, cu_seqlens=None, **kw):
        if cu_seqlens is None:
            return torch_kernel(query, key, value, g=g, beta=beta, **kw)
        b = cu_seqlens.tolist()
        outs = [torch_kernel(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kw)[0]
                for s, e in zip(b[:-1], b[1:])]
        return torch.cat(outs, 1), None

    return kernel


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_baseline_matches_the_float32_reference(checkpoints, family: str, monkeypatch) -> None:
    """Qwen3.5 through the baseline, packed (the sequences kept apart in attention, in the gated
    delta rule by its segments, in the convolution by the separators) and left-padded: both
    match the float32 reference request by request."""
    import torch
    import transformers as tf
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    path = checkpoints[family]
    for mod in (modeling_qwen3_5, modeling_qwen3_5_moe):
        fn = mod.torch_chunk_gated_delta_rule
        monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", segment_by_segment(getattr(fn, "__wrapped__", fn)))
    packed = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation=hf_baseline.register_packed_attention())
    reqs = _requests(3)
    assert len(hf_baseline.packed_batches(reqs, hf_baseline.conv_separators(packed), 64)) > 2
    for model, pack in ((packed.eval(), True), (hf_model(path), False)):
        _, results, _ = hf_baseline.run(model, reqs, keep_results=True, max_padded=64, pack=pack)
        for r, got in zip(reqs, results):
            ref = reference_scores(path, r.tokens.tolist(), r.cand, r.start)
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
        sample = hf_baseline.check_sample(model, reqs[:2], stride=3)
        assert hf_baseline.compare(sample, results[:2])["max_abs_diff"] < 1e-5


def test_layouts(monkeypatch) -> None:
    """``padded`` is DESIGN's recipe for every model; ``packed`` needs a hybrid model and fla-core
    (refused before any model is loaded otherwise); ``auto`` packs exactly when it can."""
    hybrid, dense = {"layer_types": ["linear_attention", "full_attention"]}, {}
    for fla in (False, True):
        monkeypatch.setattr(hf_baseline, "can_pack", lambda fla=fla: fla)
        assert hf_baseline.resolve_layout("padded", hybrid) is False
        assert hf_baseline.resolve_layout("auto", hybrid) is fla
        assert hf_baseline.resolve_layout("auto", dense) is False
        with pytest.raises(ValueError, match="hybrid"):
            hf_baseline.resolve_layout("packed", dense)
    monkeypatch.setattr(hf_baseline, "can_pack", lambda: False)
    with pytest.raises(ValueError, match="hybrid"):
        hf_baseline.resolve_layout("packed", hybrid)
    monkeypatch.setattr(hf_baseline, "can_pack", lambda: True)
    assert hf_baseline.resolve_layout("packed", hybrid) is True
    with pytest.raises(ValueError, match="unknown"):
        hf_baseline.resolve_layout("ragged", hybrid)
