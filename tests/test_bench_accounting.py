"""What the engine benchmark counts: the MFU of computed tokens only (prefix-cache hits are
not computed), every result checked (a row never computed stays NaN), the HTTP runs' server
with its prefix cache off whatever a variant says, and tensor-parallel ratios per GPU."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_engine
from workloads import H200_PEAK, QWEN3_8B, flops, make_workload

from teacher_server.cli import config_from_args


def test_mfu_counts_computed_tokens_only() -> None:
    """A cache-on run's MFU leaves out the tokens the cache served (else W2 with the cache on
    reads over 1.0); ``mfu_all_tokens`` keeps the all-tokens figure beside it."""
    reqs = make_workload("W2", QWEN3_8B["vocab_size"])[:16]
    cached = [0] + [2048] * 15
    got = bench_engine.summarize("W2", QWEN3_8B, reqs, 1.0, [1.0], 0.0, cached=cached, gpus=1)
    want = flops(QWEN3_8B, reqs, computed_only=True, cached=cached) / H200_PEAK
    assert got["mfu"] == pytest.approx(want)
    assert got["mfu_all_tokens"] == pytest.approx(flops(QWEN3_8B, reqs) / H200_PEAK)
    assert got["mfu"] < 0.6 * got["mfu_all_tokens"] and got["cached_tokens"] == 15 * 2048
    none = bench_engine.summarize("W2", QWEN3_8B, reqs, 1.0, [1.0], 0.0, cached=[0] * 16, gpus=1)
    assert none["mfu"] == pytest.approx(got["mfu_all_tokens"]) and "mfu_all_tokens" not in none


def _args(**kw) -> argparse.Namespace:
    base = dict(budget=None, tensor_parallel_size=1, pipeline_parallel_size=1, load_format="auto", tp_comm_parts=None,
                step_trace="")
    return argparse.Namespace(**(base | kw))


def test_http_variant_cannot_turn_the_prefix_cache_on(tmp_path) -> None:
    """The server's flags are last-wins: the cache's off switch comes after a variant's."""
    for extra in ([], ["--enable-prefix-caching"], ["--body-read-slots", "4", "--enable-prefix-caching"]):
        argv = bench_engine.server_args(tmp_path, _args(), 18000, None, extra, "W1")
        cfg = config_from_args(["serve", *argv])
        assert cfg.enable_prefix_caching is False, extra


def _answer(m: np.ndarray, cached: int = 0) -> bytes:
    buf = io.BytesIO()
    np.save(buf, m)
    return json.dumps({"prompt_token_id_logprobs": base64.b64encode(buf.getvalue()).decode(),
                       "usage": {"prompt_tokens_details": {"cached_tokens": cached}}}).encode()


def test_http_run_refuses_non_finite_answers_and_reads_cache_hits(monkeypatch) -> None:
    """Every answer's matrix is checked (after the clock), not only its status and shape; each
    answer's cache hits come back for the MFU."""
    reqs = make_workload("W1f", 1000)[:3]
    for r in reqs:  # small: the bodies are built (and ignored by the stub server)
        r.cand = r.cand[:4, :2]
    nan_at = {2}

    async def fake_post(url: str, path: str, body: bytes, sent: dict | None = None) -> tuple[int, bytes]:
        i = fake_post.n
        fake_post.n += 1
        m = np.zeros((4, 2), np.float32) - 1.0
        if i in nan_at:
            m[3, 1] = np.nan
        return 200, _answer(m, cached=7 * i)

    monkeypatch.setattr(bench_engine, "raw_post", fake_post)
    fake_post.n = 0
    with pytest.raises(AssertionError, match="non-finite"):
        asyncio.run(bench_engine.http_run("http://127.0.0.1:1", reqs, 1, "raw"))
    nan_at.clear()
    fake_post.n = 0
    run = asyncio.run(bench_engine.http_run("http://127.0.0.1:1", reqs, 1, "raw"))
    assert run.cached == [0, 7, 14] and len(run.latencies) == 3


def test_in_process_run_checks_every_result(monkeypatch) -> None:
    """A result the engine never filled (NaN) fails the run wherever it is, not only in the
    first four; the MFU counts the tokens the engine computed."""
    from teacher_server.engine.request import ScoreResult

    reqs = make_workload("W1f", 1000)[:6]

    def results(bad: int | None) -> list:
        out = []
        for i, r in enumerate(reqs):
            res = ScoreResult(f"r{i}", i, len(r.tokens))
            res.token_id_logprobs = np.full(r.cand.shape, -1.0 if i != bad else np.nan, np.float32)
            res.cached_tokens = 16 * i
            out.append(res)
        return out

    class Stats:
        def __init__(self) -> None:
            from teacher_server.engine.stats import StepTiming

            self.timing, self.steps, self.computed_tokens = StepTiming(), 0, 0

    class FakeEngine:
        def stats(self) -> Stats:
            return Stats()

    for bad, ok in ((None, True), (5, False)):
        monkeypatch.setattr(bench_engine, "run_engine", lambda e, q, t, bad=bad: (1.0, [1.0] * 6, results(bad)))
        if ok:
            out = bench_engine.timed_run(FakeEngine(), QWEN3_8B, "W1f", reqs, 0)
            cached = [16 * i for i in range(6)]  # the engine's cache hits are left out of the MFU
            assert out["cached_tokens"] == sum(cached)
            assert out["mfu"] == pytest.approx(flops(QWEN3_8B, reqs, True, cached) / H200_PEAK)
        else:
            with pytest.raises(AssertionError, match="non-finite"):
                bench_engine.timed_run(FakeEngine(), QWEN3_8B, "W1f", reqs, 0)


def test_tensor_parallel_speedup_is_also_given_per_gpu() -> None:
    ours = {"seconds": 7.8, "gpus": 2, "mfu": 0.5}
    base = {"seconds": 16.95, "gpus": 1, "mfu": 0.5}
    out = bench_engine.summary({"baseline": {"W4": base}, "engine": {"W4": ours}, "prefix_cache": {}})
    assert out["W4_x_transformers"] == pytest.approx(16.95 / 7.8)
    assert out["W4_x_transformers_per_gpu"] == pytest.approx(16.95 / 7.8 / 2)
    one = bench_engine.summary({"baseline": {"W4": base}, "engine": {"W4": dict(ours, gpus=1)}, "prefix_cache": {}})
    assert "W4_x_transformers_per_gpu" not in one


def test_results_record_their_provenance() -> None:
    p = bench_engine.provenance()
    assert p["argv"] == sys.argv and p["versions"]["torch"]
    assert p["commit"] is None or len(p["commit"]) >= 7


def test_a_failed_baseline_leaves_the_engine_runs_going(monkeypatch, tmp_path) -> None:
    """The transformers process dying (an out-of-memory on a smaller GPU) is reported, not raised:
    the engine's runs of the same call still happen and are written, without ratios."""
    import subprocess

    calls = []

    def fails(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench_engine.subprocess, "run", fails)
    got = bench_engine.run_baseline(tmp_path, ["W1f"], 1, True)
    assert got == {"error": "hf_baseline.py exited 1"} and calls and "--dummy" in calls[0]


def test_an_http_pass_splits_into_its_steps_and_the_time_around_them(tmp_path: Path) -> None:
    """trace_window: the steps launched inside the pass's clock, the wall time before the first
    launch (and when the first request was received, its body whole, parsed) and after the last
    completion, their GPU time; steps of another pass are not counted."""
    path = tmp_path / "http-W1f.jsonl"
    steps = [{"step": 1, "tokens": 4096, "clock": [99.0, 99.5], "gpu_ms": 500.0},  # the warm-up's, before the pass
             {"step": 2, "tokens": 4096, "clock": [100.25, 100.75], "gpu_ms": 400.0, "gpu_idle_ms": 1.0, "pid": 7,
              "launch_ms": 380.0,
              "arrived": [100.125, 100.2], "received": [100.0625, 100.1], "read": [100.1, 100.15],
              "handed": [100.1875, 100.2]},
             {"step": 3, "tokens": 32768, "clock": [100.75, 103.5], "gpu_ms": 2700.0, "gpu_idle_ms": 2.0, "pid": 7,
              "arrived": [100.3, 100.6], "received": [100.03125, 100.5], "read": [100.25, 100.55]},
             {"step": 4, "tokens": 8192, "clock": [103.5, 103.8], "gpu_ms": 300.0, "pid": 7}]
    path.write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"step": 5, "tok')  # the last line cut short
    got = bench_engine.trace_window(str(path), 100.0, 104.0)
    # (the earliest over the pass's steps: a request received first may be parsed later)
    assert got == {"steps": 3, "head_s": 0.25, "head_to_first_received_s": 0.0312, "head_to_first_body_s": 0.1,
                   "head_to_first_arrival_s": 0.125, "head_to_first_handed_s": 0.1875, "tail_s": 0.2, "gpu_s": 3.4,
                   "gpu_idle_s": 0.003, "gpu_share_of_wall": 0.85, "engines": 1, "first_step_tokens": 4096,
                   "first_step_gpu_ms": 400.0, "first_step_launch_ms": 380.0}
    assert bench_engine.trace_window(str(path), 200.0, 210.0) is None
    assert bench_engine.trace_window(str(tmp_path / "missing.jsonl"), 100.0, 104.0) is None


def test_ablation_names_are_checked_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """--ablate-only with a name no variant has is a usage error at once (on the device it would
    have failed after the model loaded); ABLATIONS lists the variants ``ablate`` builds."""
    import re

    src = (Path(bench_engine.__file__)).read_text()
    body = src[src.index("    variants = {"):src.index("    assert tuple(variants) == ABLATIONS")]
    assert tuple(re.findall(r'^        "([a-z0-9_]+)": lambda', body, re.M)) == bench_engine.ABLATIONS
    argv = sys.argv
    sys.argv = ["bench_engine.py", "--tiny", "--ablate", "W1:tiny", "--ablate-only", "as_configured,eager_gated_atention"]
    try:
        with pytest.raises(SystemExit) as e:
            bench_engine.main()
    finally:
        sys.argv = argv
    assert e.value.code == 2 and "no variant eager_gated_atention" in capsys.readouterr().err


def test_the_http_server_gets_the_engines_max_model_len(tmp_path: Path) -> None:
    """Gemma 3's own max_model_len (131,072) did not fit the H200's pool and its server refused to
    start: the HTTP runs' server takes the in-process engine's max_model_len."""
    args = argparse.Namespace(budget=0, tensor_parallel_size=1, pipeline_parallel_size=1, load_format="auto",
                              tp_comm_parts=0, quantization=None, moe_parallel=None, step_trace="", max_model_len=8192)
    out = bench_engine.server_args(tmp_path, args, 18000, None, [], "W1f")
    assert out[out.index("--max-model-len") + 1] == "8192"
