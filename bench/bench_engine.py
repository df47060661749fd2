"""Engine benchmark on the canonical workloads (docs/design.md, section 3), side by side with
the transformers baseline on the same requests in the same run.

  python bench/bench_engine.py --workloads W1,W1f,W3 --http W1 --baseline W1,W1f,W3
  python bench/bench_engine.py --model-size 32b --workloads W4 --baseline W4
  python bench/bench_engine.py --model-size 30b-a3b --workloads W1,W1f --baseline W1,W1f
  python bench/bench_engine.py --workloads W1 --prefix-cache-compare W2,L131072
  python bench/bench_engine.py --model-size 32b --workloads W4 --tensor-parallel-size 2
  python bench/bench_engine.py --model-size 32b --workloads W4 --pipeline-parallel-size 2
  python bench/bench_engine.py --model-size 70b --workloads W1f --tensor-parallel-size 2
  python bench/bench_engine.py --model-size 235b-a22b --workloads W1f --tensor-parallel-size 8 --profile W1f
  python bench/bench_engine.py --model-size qwen3.5-9b --workloads W1 --baseline W1,W2 --prefix-cache-compare W2
  python bench/bench_engine.py --model-size moonlight --workloads W1f --http W1f --baseline W1f
  python bench/bench_engine.py --model-size deepseek-v3-layers --workloads W1f
  python bench/bench_engine.py --model-size gpt-oss-20b --workloads W1 --http W1 --baseline W1
  python bench/bench_engine.py --model-size qwen3-next-80b-a3b --workloads W1 --http W1 --baseline W1
  python bench/bench_engine.py --model-size gemma3-27b --workloads W1f --http W1f --baseline W1f
  python bench/bench_engine.py --model-size glm4.5-air --workloads W1f --http W1f --baseline W1f

Qwen3-8B and the hybrid Qwen3.5-9B (W7: Gated DeltaNet and gated full-attention layers; the
baseline packs its sequences, see hf_baseline.py) are written as safetensors (random bf16
weights, written once) and loaded through the real loader by the engine and the baseline
alike, so a sample of the baseline's cells is compared with the engine's (``baseline_check``:
bf16 against bf16, a few hundredths of a nat apart). Qwen3-32B, Llama-3.3-70B and the Qwen3-30B-A3B MoE (W5: 128 experts, top-8; MFU counts
active parameters) use the dummy load format (random weights made in place, per shard under
tensor parallel). With ``--tensor-parallel-size N`` throughput is also given per GPU and MFU is
per GPU (the achieved FLOP/s over N GPUs' peak). Writes a JSON results file and prints a table
last.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_telemetry import GpuTelemetry, mfu_at_clock
from hf_baseline import CHECK_REQUESTS, compare
from workloads import (
    BLOCK_FP8_CONFIG,
    DEEPSEEK_V3_LAYERS,
    GEMMA3_27B,
    GLM45_AIR_LAYERS,
    GPT_OSS_20B,
    H200_PEAK,
    LLAMA33_70B,
    MOONLIGHT_16B_A3B,
    QWEN3_5_9B,
    QWEN3_5_35B_A3B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_32B,
    QWEN3_235B_A22B,
    QWEN3_NEXT_80B_A3B_LAYERS,
    Req,
    flop_ideal_speedup,
    flops,
    make_workload,
    tiny,
    with_layers,
    write_config,
    write_random_checkpoint,
)

from teacher_server.client.protocol import loads, parse_output
from teacher_server.compile_cache import use_compile_cache
from teacher_server.config import Config
from teacher_server.engine.engine import Engine
from teacher_server.engine.request import ScoreRequest
from teacher_server.ops.fused import SWITCHES


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def to_score_requests(reqs: list[Req], tag: str) -> list[ScoreRequest]:
    return [ScoreRequest(f"{tag}-{i}", r.tokens, r.start, r.cand.astype(np.int64), max_tokens=1)
            for i, r in enumerate(reqs)]


def sync() -> None:
    """Wait for the GPU (a CPU smoke run has none)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_bytes(reset: bool = False) -> float:
    """Peak GPU memory allocated since the last reset (NaN on the CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return float(torch.cuda.max_memory_allocated())


def run_engine(engine: Engine, reqs: list[Req], tag: str) -> tuple[float, list[float], list]:
    srs = to_score_requests(reqs, tag)
    sync()
    t0 = time.perf_counter()
    for r in srs:
        engine.add_request(r)
    done: dict[str, float] = {}
    results = {}
    while engine.has_unfinished():
        for res in engine.step():
            done[res.request_id] = time.perf_counter() - t0
            results[res.request_id] = res
    sync()
    dt = time.perf_counter() - t0
    return dt, [done[r.request_id] for r in srs], [results[r.request_id] for r in srs]


GPUS = 1  # GPUs of the run: tensor x pipeline parallel size (set by main)
TELEMETRY: GpuTelemetry | None = None  # the GPUs' power and clocks over the runs (set by main; None on the CPU)


def telemetry_indices(gpus: int) -> list[int]:
    """nvidia-smi's indices of the GPUs the run uses (CUDA_VISIBLE_DEVICES, where it lists numbers)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible):
        return [int(v) for v in visible[:gpus]]
    return list(range(gpus))


def gpu_window(out: dict, t0: float, t1: float) -> None:
    """Add the GPUs' power and clock over [t0, t1] (``time.monotonic()``) to a run's summary, and
    its MFU at the clock it ran at (``gpu_telemetry``)."""
    if TELEMETRY is None:
        return
    w = TELEMETRY.window(t0, t1)
    if w is None:
        return
    props = torch.cuda.get_device_properties(0)
    at = mfu_at_clock(out["mfu"] * H200_PEAK, w["sm_mhz_mean"], props.multi_processor_count, props.major)
    out["gpu"] = w
    out["mfu_at_clock"] = round(at, 4) if at is not None else None


def summarize(name: str, cfg: dict, reqs: list[Req], seconds: float, lat: list[float], peak: float,
              cached: list[int] | None = None, gpus: int | None = None) -> dict:
    """MFU is per GPU: achieved FLOP/s over the peak of the GPUs used. ``cached``: each
    request's tokens the prefix cache served (not computed, so not counted in the MFU; tokens/s
    counts every token, as served). A run with hits also gives ``mfu_all_tokens``, the MFU as
    if they had been computed."""
    gpus = GPUS if gpus is None else gpus
    tokens = sum(len(r.tokens) for r in reqs)
    rows = sum(r.rows for r in reqs)
    hits = sum(cached) if cached else 0
    f = flops(cfg, reqs, computed_only=hits > 0, cached=cached)
    out = {"workload": name, "seconds": seconds, "tokens": tokens, "scored_rows": rows, "gpus": gpus,
           "tokens_per_s": tokens / seconds, "scored_tokens_per_s": rows / seconds,
           "tokens_per_s_per_gpu": tokens / seconds / gpus,
           "mfu": f / seconds / (H200_PEAK * gpus), "peak_gib": peak / 2**30,
           "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99)}
    if cached is not None:
        out["cached_tokens"] = hits
    if hits:
        out["mfu_all_tokens"] = flops(cfg, reqs) / seconds / (H200_PEAK * gpus)
    return out


def bench_engine(engine: Engine, cfg: dict, name: str, reqs: list[Req], repeats: int) -> dict:
    run_engine(engine, reqs[: max(2, len(reqs) // 8)], f"warm-{name}")  # warm-up: kernels, allocator
    engine.reset_prefix_cache()
    runs = []
    for k in range(repeats if len(reqs) > 1 else min(repeats, 2)):  # one long request: two runs
        runs.append(timed_run(engine, cfg, name, reqs, k))
        engine.reset_prefix_cache()
    best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    best["runs_seconds"] = [r["seconds"] for r in runs]
    # every run's host stages (a first run that pays one-time work shows in its launch_s)
    best["runs_launch_s"] = [r["_timing"]["launch_s"] for r in runs]
    best["host_stages_s"] = best.pop("_timing")
    best["runs_gpu"] = [run_gpu(r) for r in runs]
    return best


def run_gpu(run: dict) -> dict | None:
    """A run's power and clock in brief (None without telemetry)."""
    g = run.get("gpu")
    if not g:
        return None
    return {"power_w_mean": g["power_w_mean"], "sm_mhz_mean": g["sm_mhz_mean"],
            "sw_power_cap_share": g["sw_power_cap_share"], "mfu_at_clock": run.get("mfu_at_clock")}


def timed_run(engine: Engine, cfg: dict, name: str, reqs: list[Req], k: int) -> dict:
    """One run, with the engine's per-stage host time over it (wait_s: the host waiting
    for the GPU; the rest is host work, overlapped with the GPU when pipelined)."""
    before = engine.stats()
    peak_bytes(reset=True)
    m0 = time.monotonic()
    with FrozenHeap() as gc_pauses:  # as the server freezes its start-up heap
        dt, lat, res = run_engine(engine, reqs, f"{name}-{k}")
    m1 = time.monotonic()
    assert all(r.error is None for r in res), [r.error for r in res if r.error][:3]
    assert all(r.token_id_logprobs.shape == (q.rows, q.cand.shape[1]) for r, q in zip(res, reqs))
    bad = [r.request_id for r in res if not np.isfinite(r.token_id_logprobs).all()]
    assert not bad, f"non-finite scores in {len(bad)} results: {bad[:3]}"  # a row never computed stays NaN
    out = summarize(name, cfg, reqs, dt, lat, peak_bytes(), cached=[r.cached_tokens for r in res])
    gpu_window(out, m0, m1)
    after = engine.stats()
    out["_timing"] = {k: round(v, 4) for k, v in asdict(after.timing.minus(before.timing)).items()}
    out["_timing"] |= {"steps": after.steps - before.steps, "tokens": after.computed_tokens - before.computed_tokens,
                       "gc_s": round(gc_pauses.seconds, 4)}
    return out


# FusedOps' kernel switches the results record and the ablations turn off (conv_kernel: Qwen3.5's)
KERNEL_SWITCHES = SWITCHES  # FusedOps' kernel switches (the results' kernels_on, the ablations' state)


# the variants of --ablate (``ablate``), in their default order; --ablate-only names some of them
ABLATIONS = ("as_configured", "varlen_attention", "cudnn_attention", "cudnn_fe_attention", "one_attention_stream",
             "residual_add_outside_gemm", "all_rows_last_layer", "no_prefix_groups", "no_pipeline", "budget_x2",
             "budget_half", "split_to_fill", "eager_stages", "no_cuda_kernels", "no_fused_gate_up",
             "no_combine_kernel", "flip_moe_gate_up", "no_fp8_moe_kernel", "no_router_kernel", "flip_group_kernel",
             "no_router_gemm_split", "eager_gated_attention", "no_gated_qk_kernel", "no_conv_kernel",
             "fp8_norm_then_quant", "padded_values", "copied_views")


def ablate(engine: Engine, cfg: dict, name: str, reqs: list[Req], repeats: int, only: list[str]) -> dict:
    """The same workload with one optimisation taken away at a time (same process, same
    weights): what each is worth."""
    from teacher_server.attention import make_backend
    from teacher_server.ops.fused import _STAGES

    out = {}
    saved = engine.tuning
    attn = saved.attention
    streams = getattr(attn, "concurrent_streams", 0)
    grouped = getattr(attn, "group_prefixes", False)
    narrow_v = attn.distinct_v_width
    views_ok = getattr(attn, "views_ok", None)
    ops = engine.runner.ops  # the fused stages and our CUDA kernels (not part of the tuning either)
    ops_saved = {n: getattr(ops, n) for n in (*_STAGES, *KERNEL_SWITCHES)}

    def tune(**kw) -> None:  # noqa: ANN003
        engine.tuning = replace(saved, **kw)

    backends: dict[str, object] = {}

    def attention(kind: str) -> None:  # a backend made once per process (its plans or graphs kept)
        if kind not in backends:
            backends[kind] = make_backend(kind, engine.device)
            spec = engine.runner.spec
            # up to a step's tokens, as the engine's runner warms its own (a fresh call is at most one step)
            backends[kind].warm_up(min(engine.max_model_len, saved.token_budget), spec.num_heads, spec.num_kv_heads,
                                   spec.head_dim, engine.device, torch.bfloat16, layers=len(spec.kv_layer_ids))
        tune(attention=backends[kind])

    variants = {
        "as_configured": lambda: None,
        "varlen_attention": lambda: tune(attention=make_backend("varlen", engine.device)),
        # the bucketed per-sequence cuDNN calls / cuDNN's Python frontend on the packed layout
        "cudnn_attention": lambda: attention("cudnn"),
        "cudnn_fe_attention": lambda: attention("cudnn_fe"),
        "one_attention_stream": lambda: setattr(attn, "concurrent_streams", 0),
        "residual_add_outside_gemm": lambda: tune(residual_in_gemm=False),
        # the last layer's o projection, MLP and norms over every row, not only those the LM head reads
        "all_rows_last_layer": lambda: tune(last_layer_rows_only=False),
        "no_prefix_groups": lambda: setattr(attn, "group_prefixes", False),
        "no_pipeline": lambda: tune(pipeline=False),
        "budget_x2": lambda: tune(token_budget=2 * saved.token_budget),
        "budget_half": lambda: tune(token_budget=saved.token_budget // 2),
        # every sequence split to fill the step (no whole-sequence packing)
        "split_to_fill": lambda: tune(whole_fill=1.0),
        # the norms, QKV and linear-layer stages uncompiled (each a chain of torch passes)
        "eager_stages": lambda: [setattr(ops, n, f) for n, f in _STAGES.items()],
        # SiLU-mul and the fused QKV/rotary/KV-write kernel replaced by their torch references (and the
        # fused gate/up kernel off, else the dense MLP would not run SiLU-mul at all)
        "no_cuda_kernels": lambda: [setattr(ops, n, False) for n in KERNEL_SWITCHES if n != "conv_kernel"],
        # the gate/up GEMM (cuBLAS) and then the SiLU-mul kernel (Gemma: GELU-mul), instead of the fused Triton kernel
        "no_fused_gate_up": lambda: [setattr(ops, n, False) for n in ("gate_up_kernel", "gate_up_gelu_kernel")],
        # expert layers: the combine as torch's embedding_bag; the gather, grouped GEMM and SiLU-mul as three
        # passes (or, where the warm-up left them so, the fused kernel forced on)
        "no_combine_kernel": lambda: setattr(ops, "combine_kernel", False),
        "flip_moe_gate_up": lambda: setattr(ops, "moe_gate_up_kernel", not ops_saved["moe_gate_up_kernel"]),
        # FP8 experts: the gather, gate/up product and SiLU-mul + quantization as passes, not ops.fp8_moe's kernel
        # (on only where its check passed: it cannot be forced on)
        "no_fp8_moe_kernel": lambda: setattr(ops, "fp8_moe_kernel", False),
        "no_router_kernel": lambda: setattr(ops, "router_kernel", False),  # the router (sigmoid or softmax) in torch
        # the expert rows grouped by torch's sort (or, where the warm-up left it so, the counting kernels forced on)
        "flip_group_kernel": lambda: setattr(ops, "group_kernel", not ops_saved["group_kernel"]),
        # DeepSeek's float32 router logits: the input copied to float32 and a float32 GEMM (not the bf16 parts)
        "no_router_gemm_split": lambda: setattr(ops, "router_gemm_split", False),
        # Qwen3.5's gated attention: its q/k/v stage and output gate eager (a chain of passes each)
        "eager_gated_attention": lambda: [setattr(ops, n, f) for n, f in (("gated_qk_prep", _STAGES["gated_qk_prep"]),
                                          ("sigmoid_gate", _STAGES["sigmoid_gate"]), ("gated_qk_kernel", False))],
        # Qwen3.5's gated attention: its q/k/v input stage compiled (or eager) rather than the Triton kernel
        "no_gated_qk_kernel": lambda: setattr(ops, "gated_qk_kernel", False),
        # Qwen3.5: the linear layers' convolution and input stage as two passes (fla-core's, then compiled)
        "no_conv_kernel": lambda: setattr(ops, "conv_kernel", False),
        # FP8 models: the q/k/v and gate/up inputs normed in bf16, then quantized in a pass of their own
        "fp8_norm_then_quant": lambda: setattr(ops, "fp8_norm_input", False),
        # latent attention: values zero-padded to the key width and the output's extra columns dropped, as for a
        # backend that takes values only as wide as keys (the backend's own calls otherwise take them as they are)
        "padded_values": lambda: setattr(attn, "distinct_v_width", False),
        # latent attention: q copied out rotated and v copied out of kv_b_proj's output, as for a backend that takes
        # no strided views (cudnn_fe otherwise takes q rotated where it was made and v where kv_b_proj wrote it)
        "copied_views": lambda: setattr(attn, "views_ok", False),
    }
    assert tuple(variants) == ABLATIONS, "ABLATIONS lists the variants"
    tp = getattr(engine, "_workers", None) is not None
    runs: dict[str, int] = {}
    for v in only or list(variants):  # in the order asked for; a name asked for again: key 'name#2'
        runs[v] = runs.get(v, 0) + 1
        key = v if runs[v] == 1 else f"{v}#{runs[v]}"
        if tp and v in ("eager_stages", "eager_gated_attention", "no_cuda_kernels", "no_conv_kernel", "no_fused_gate_up",
                        "all_rows_last_layer", "no_combine_kernel", "flip_moe_gate_up", "no_fp8_moe_kernel",
                        "no_router_kernel",
                        "flip_group_kernel", "no_router_gemm_split", "no_gated_qk_kernel"):  # the workers' own
            out[key] = {"skipped": "tensor parallel: only rank 0's stages and model would change"}
            continue
        apply = variants[v]
        apply()
        state = {"compiled_stages": [n for n in _STAGES if getattr(ops, n) is not _STAGES[n]],
                 **{n: getattr(ops, n) for n in KERNEL_SWITCHES}}  # what the variant ran with
        try:
            out[key] = bench_engine(engine, cfg, f"{name}-{key}", reqs, repeats)
            out[key]["ops"] = state
            if hasattr(engine.tuning.attention, "builds"):  # cudnn_fe: graphs built so far, warm-up included
                out[key]["attention_graph_builds"] = len(engine.tuning.attention.builds)
            print(f"ablation {name} {key}: {out[key]['tokens_per_s']:.0f} tok/s, MFU {out[key]['mfu']:.3f}", flush=True)
        except torch.cuda.OutOfMemoryError as e:
            out[key] = {"error": str(e)[:200]}
            torch.cuda.empty_cache()
        finally:
            # the backend's own switches are its attributes (not part of the engine's tuning)
            engine.tuning = saved
            if hasattr(attn, "concurrent_streams"):
                attn.concurrent_streams = streams
            if hasattr(attn, "group_prefixes"):
                attn.group_prefixes = grouped
            attn.distinct_v_width = narrow_v
            if hasattr(attn, "views_ok"):
                attn.views_ok = views_ok
            for n, f in ops_saved.items():
                setattr(ops, n, f)
    return out


# --- HTTP path -----------------------------------------------------------------------------

def npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


def http_body(r: Req) -> bytes:
    """A workload request as the HTTP benchmark sends it: token ids as JSON, candidates as a
    base64 .npy."""
    try:
        import orjson
        dumps = orjson.dumps
    except ImportError:  # pragma: no cover
        dumps = lambda o: json.dumps(o).encode()  # noqa: E731
    return dumps({"token_ids": r.tokens.tolist(), "sampling_params": {
        "max_tokens": 1, "prompt_logprob_start": r.start, "prompt_logprob_token_ids": npy_b64(r.cand)}})


async def raw_post(url: str, path: str, body: bytes, sent: dict[str, float] | None = None) -> tuple[int, bytes]:
    """POST body on a fresh HTTP/1.1 connection with asyncio streams alone (no client library:
    what the server costs, apart from a client's own overhead). Returns (status, response body);
    ``sent`` gets the clock (``time.monotonic()``) when the headers were handed to the socket
    (``headers``) and when the body's last byte was (``body``)."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head)
        if sent is not None:
            sent["headers"] = time.monotonic()
        writer.write(body)
        await writer.drain()
        if sent is not None:
            sent["body"] = time.monotonic()
        status = int((await reader.readline()).split()[1])
        length = None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        data = await (reader.readexactly(length) if length is not None else reader.read())
        return status, data
    finally:
        writer.close()


@dataclass
class HttpRun:
    seconds: float  # from the first request sent to the last answer read
    latencies: list[float]
    start: float  # ``time.monotonic()`` at the first send
    cached: list[int]  # each request's prefix-cache hits, as its answer's usage reports them
    client_gc_s: float = 0.0  # the client's own garbage-collector pauses inside ``seconds``
    # per request, the client's clock (``time.monotonic()``) when its headers and its body's last byte
    # went to the socket (``headers``, ``body``; either missing where the client did not say)
    sent: list[dict[str, float]] = field(default_factory=list)

    def sending(self) -> dict[str, float]:
        """The client's side of the pass's head: seconds from its first send until a first request's
        headers and a first whole body had left it, and until the last body had (the upload's end)."""
        out = {}
        for key, name, pick in (("headers", "first_headers_sent_s", min), ("body", "first_body_sent_s", min),
                                ("body", "last_body_sent_s", max)):
            ts = [s[key] for s in self.sent if key in s]
            if ts:
                out[name] = round(pick(ts) - self.start, 4)
        return out


async def http_run(url: str, reqs: list[Req], concurrency: int, client: str = "httpx") -> HttpRun:
    """``reqs`` through the server at ``url``, ``concurrency`` at a time. client: ``httpx`` (one
    AsyncClient, its connection pool) or ``raw`` (``raw_post``: a fresh connection per request,
    no client library). Every answer must be a 200 with a finite matrix of the request's shape
    (checked after the clock stops); each is decoded inside the clock as teacher_server's client
    decodes one (``client.protocol``: orjson and pybase64 where installed).

    The client runs in the benchmark's process, which holds torch, transformers and perhaps an
    in-process engine: a few hundred thousand objects that each full collection of Python's
    cyclic garbage collector walks (~0.1 s) on the event loop that sends the uploads. A
    client of its own would not carry them, so they are frozen out of the collector's sight
    for the pass (``gc.freeze``, as the server does with its start-up heap); the collector's
    pauses that remain are reported (``client_gc_s``)."""
    import httpx

    bodies = [http_body(r) for r in reqs]
    sem = asyncio.Semaphore(concurrency)
    lat = [0.0] * len(reqs)
    mats: list = [None] * len(reqs)
    cached = [0] * len(reqs)
    sent: list[dict[str, float]] = [{} for _ in reqs]

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def post(i: int) -> tuple[int, bytes]:
            if client == "raw":
                return await raw_post(url, "/inference/v1/generate", bodies[i], sent[i])

            async def trace(event: str, info: dict) -> None:  # (httpcore's events: when the bytes left)
                if event in ("http11.send_request_headers.complete", "http11.send_request_body.complete"):
                    sent[i]["headers" if "headers" in event else "body"] = time.monotonic()

            r = await c.post("/inference/v1/generate", content=bodies[i], headers={"content-type": "application/json"},
                             extensions={"trace": trace})
            return r.status_code, r.content

        async def one(i: int) -> None:
            async with sem:
                s = time.perf_counter()
                status, data = await post(i)
                assert status == 200, data[:300]
                out = parse_output(loads(data))  # decoded as teacher_server's client decodes an answer
                mats[i], cached[i] = out.scores, out.cached_tokens
                lat[i] = time.perf_counter() - s

        with FrozenHeap() as gc_pauses:
            t0, clock = time.perf_counter(), time.monotonic()
            await asyncio.gather(*(one(i) for i in range(len(reqs))))
            dt = time.perf_counter() - t0
    for i, (m, r) in enumerate(zip(mats, reqs)):
        assert m.shape == r.cand.shape, (i, m.shape, r.cand.shape)
        assert np.isfinite(m).all(), f"request {i}: non-finite scores"
    return HttpRun(dt, lat, clock, cached, round(gc_pauses.seconds, 4), sent)


class FrozenHeap:
    """The benchmark process's heap frozen out of the garbage collector while a pass runs
    (through HTTP: its client; in-process: the engine, as a server's is after start-up), and
    the collector's pauses meanwhile (``seconds``)."""

    def __init__(self) -> None:
        self.seconds, self._t = 0.0, 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t

    def __enter__(self) -> FrozenHeap:
        self._frozen_before = gc.get_freeze_count()  # a server in this process (tests) froze its own
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)
        if not self._frozen_before:  # (gc.unfreeze thaws all: what was frozen before stays, with this pass's)
            gc.unfreeze()


def server_stages(url: str) -> dict[str, float]:
    """The server's engine-thread seconds per step stage and its step count, from /metrics."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("teacher_server_engine_stage_seconds_total{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage + "_s"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("teacher_server_engine_gpu_seconds_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out["gpu_s" if kind == "busy" else "gpu_idle_s"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("teacher_server_engine_steps_total{"):
            out["steps"] = float(line.rsplit(" ", 1)[1])
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until the server started as ``proc`` answers /health with 200 (it loads meanwhile)."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("server exited during startup")
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready after {timeout_s:.0f}s")


def _modes(text: str) -> list[str]:
    """--http-engine's comma-separated list of default, thread, process."""
    modes = text.split(",")
    if not modes or set(modes) - {"default", "thread", "process"}:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of default, thread, process")
    return modes


def _clients(text: str) -> list[str]:
    """--http-client's comma-separated list of httpx, raw."""
    clients = text.split(",")
    if not clients or set(clients) - {"httpx", "raw"} or len(set(clients)) != len(clients):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of httpx, raw")
    return clients


def _variants(text: str) -> list[tuple[str, list[str]]]:
    """--http-variants: 'name=ARGS;name=ARGS' -> [(name, args)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, rest = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: expected name=server arguments")
        out.append((name.strip(), shlex.split(rest)))
    return out


def server_args(model_dir: Path, args: argparse.Namespace, port: int, engine_process: bool | None,
                extra: list[str], key: str) -> list[str]:
    """The arguments of ``teacher_server serve`` for an HTTP run (``extra``: a variant's)."""
    out = ["--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
           *(["--max-num-batched-tokens", str(args.budget)] if args.budget else []),
           "--log-level", "warning", "--tensor-parallel-size", str(args.tensor_parallel_size),
           *(["--pipeline-parallel-size", str(args.pipeline_parallel_size)] if args.pipeline_parallel_size > 1 else []),
           "--load-format", args.load_format,
           # the in-process engine's max_model_len: a model's own (Gemma 3's 131,072) may exceed the pool
           *(["--max-model-len", str(args.max_model_len)] if getattr(args, "max_model_len", None) else []),
           *(["--tp-comm-parts", str(args.tp_comm_parts)] if args.tp_comm_parts else []),
           *(["--quantization", args.quantization] if getattr(args, "quantization", None) else []),
           *(["--moe-parallel", args.moe_parallel] if getattr(args, "moe_parallel", None) else [])]
    if engine_process is not None:
        out.append("--engine-process" if engine_process else "--no-engine-process")
    # The in-process runs reset the prefix cache between runs; the server cannot, and repeats
    # of the same requests would hit it. Off, both sides do the same work: given after the
    # variant's arguments, so that a variant cannot turn it back on (the last flag wins).
    out += [*extra, "--no-enable-prefix-caching"]
    if args.step_trace:
        out += ["--step-trace", trace_path(args, key)]
    return out


def trace_path(args: argparse.Namespace, key: str) -> str:
    return f"{args.step_trace}http-{key}.jsonl"


def trace_window(path: str, t0: float, t1: float) -> dict | None:
    """Where an HTTP pass's wall time [t0, t1] (``time.monotonic()``, the clock the step trace
    shares) went, from the server's step trace: ``head_s`` before its first step's launch (the
    first request's way in; of it ``head_to_first_received_s`` until the server began handling a
    request the pass's steps hold, ``head_to_first_body_s`` until one's body was whole,
    ``head_to_first_arrival_s`` until one was parsed, ``head_to_first_handed_s`` until one was queued for the
    engine thread), ``tail_s`` after its last step completed (the last answer's way
    out), its steps' GPU time and the GPU's idle time between them (summed over the engines
    that wrote the trace: replicas append to one file), and the first step's tokens, GPU time
    and host launch time. A line cut short is skipped. None without steps in the pass."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    steps = []
    for line in text.splitlines():
        try:
            s = json.loads(line)
        except ValueError:  # (a line the engine was writing as the file was read)
            continue
        if t0 <= s["clock"][0] <= t1:
            steps.append(s)
    if not steps:
        return None
    first, last = min(s["clock"][0] for s in steps), max(s["clock"][-1] for s in steps)
    gpu = sum(s.get("gpu_ms", 0.0) for s in steps) / 1e3
    # the head split: until the server began handling a first request (the client's connecting and sending its
    # headers), until a first body was whole (the uploads), until a first request was parsed, then on to the
    # engine's first step (the hand-off to the engine, its scheduling)
    split = {}
    for key, name in (("received", "head_to_first_received_s"), ("read", "head_to_first_body_s"),
                      ("arrived", "head_to_first_arrival_s"), ("handed", "head_to_first_handed_s")):
        ts = [s[key][0] for s in steps if s.get(key)]
        if ts:
            split[name] = round(min(ts) - t0, 4)
    return {"steps": len(steps), "head_s": round(first - t0, 4), **split, "tail_s": round(t1 - last, 4),
            "gpu_s": round(gpu, 4), "gpu_idle_s": round(sum(s.get("gpu_idle_ms", 0.0) for s in steps) / 1e3, 4),
            "gpu_share_of_wall": round(gpu / (t1 - t0), 4), "engines": len({s.get("pid") for s in steps}),
            "first_step_tokens": (one := min(steps, key=lambda s: s["clock"][0]))["tokens"],
            # a step of few tokens launched onto an idle GPU: its GPU time against its host's launch time (a step
            # whose kernels take less time than launching them is timed at the launch's pace)
            "first_step_gpu_ms": one.get("gpu_ms"), "first_step_launch_ms": one.get("launch_ms")}


def bench_http(model_dir: Path, args: argparse.Namespace, cfg: dict, name: str, reqs: list[Req],
               engine_process: bool | None = None, extra: list[str] = (), key: str = "") -> dict:
    """``name`` through a real server; ``engine_process`` None: the server's default (the engine
    in a process of its own on one GPU, on a thread otherwise); ``extra``: more server arguments;
    ``key``: the run's name in the results (its step trace's file name)."""
    port = 18000 + os.getpid() % 1000
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "teacher_server", "serve",
           *server_args(model_dir, args, port, engine_process, extra, key or name)]
    if engine_process is None:  # the server's own rule, as it will apply it
        from teacher_server.replicas.pool import engine_elsewhere

        engine_process = engine_elsewhere(Config(tensor_parallel_size=args.tensor_parallel_size,
                                                 pipeline_parallel_size=args.pipeline_parallel_size))
    proc = subprocess.Popen(cmd, env=env, cwd=str(Path(__file__).resolve().parents[1]))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        clients = args.http_client
        for client in clients:  # warm-up, each client once
            asyncio.run(http_run(url, reqs[: max(2, len(reqs) // 8)], args.concurrency, client))
        runs = []
        from teacher_server.replicas.worker import STATS_INTERVAL_S

        # the engine's snapshots reach the front every STATS_INTERVAL_S: wait for the last one
        # of the run before (the warm-up's too), and of this one
        settle = 3 * STATS_INTERVAL_S if engine_process else 0.0
        # with several clients, the repeats alternate them against the same server
        for _ in range(args.repeats):
            for client in clients:
                time.sleep(settle)
                before = server_stages(url)
                run = asyncio.run(http_run(url, reqs, args.concurrency, client))
                assert not any(run.cached), "the server's prefix cache served tokens: its runs would not be comparable"
                dt, start = run.seconds, run.start
                runs.append(summarize(name + "-http", cfg, reqs, dt, run.latencies, float("nan"), cached=run.cached))
                runs[-1]["clock"] = [round(start, 4), round(start + dt, 4)]  # the server's step trace uses this clock
                if args.step_trace:
                    runs[-1]["trace"] = trace_window(trace_path(args, key or name), start, start + dt)
                runs[-1]["client_sending"] = run.sending()  # (beside the trace's server side of the head)
                runs[-1]["http_client"] = client
                runs[-1]["client_gc_s"] = run.client_gc_s
                gpu_window(runs[-1], start, start + dt)
                time.sleep(settle)
                after = server_stages(url)
                runs[-1]["server_stages_s"] = {k: round(after[k] - before.get(k, 0.0), 4) for k in after}
        # the headline: the first client's median run; every client's runs beside it
        first = [r for r in runs if r["http_client"] == clients[0]]
        best = dict(sorted(first, key=lambda r: r["seconds"])[len(first) // 2])
        best["runs_seconds"] = [r["seconds"] for r in first]
        best["runs_clock"] = [r["clock"] for r in first]
        best["runs_gpu"] = [run_gpu(r) for r in first]
        if args.step_trace:
            best["runs_trace"] = [r.get("trace") for r in first]
        best["runs_client_gc_s"] = [r["client_gc_s"] for r in first]
        best["runs_client_sending"] = [r["client_sending"] for r in first]
        if len(clients) > 1:
            best["by_client"] = {c: {"runs_seconds": [r["seconds"] for r in runs if r["http_client"] == c],
                                     "runs_mfu": [r.get("mfu") for r in runs if r["http_client"] == c],
                                     "runs_gpu": [run_gpu(r) for r in runs if r["http_client"] == c],
                                     "runs_trace": [r.get("trace") for r in runs if r["http_client"] == c]}
                                 for c in clients}
        best["concurrency"] = args.concurrency
        best["prefix_caching"] = False
        best["engine_process"] = engine_process
        best["server_args"] = list(extra)
        # the server's base64 codec (its interpreter and environment are this one's): runs without
        # pybase64, a server requirement, measure a slower request path than an install has
        from teacher_server import b64

        best["server_base64"] = "pybase64" if b64.fast() else "stdlib"
        return best
    finally:
        proc.terminate()
        proc.wait(timeout=120)


# --- main -----------------------------------------------------------------------------------


def run_baseline(ckpt: Path, names: list[str], repeats: int, dummy: bool, layouts: str = "auto") -> dict:
    """The transformers baseline in a fresh process (``hf_baseline.main``), before the engine
    exists: in one process after the engine it ran 12% slower. Results by workload; with
    several ``layouts``, the later ones' under ``name@layout``."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "hf_baseline.py"), "--ckpt", str(ckpt),
               "--workloads", ",".join(names), "--repeats", str(repeats), "--layouts", layouts, "--out", f.name] + \
            (["--dummy"] if dummy else [])
        done = subprocess.run(cmd)
        if done.returncode:  # (its traceback is in the log above) the engine's runs still go on, without ratios
            print(f"WARNING: the transformers baseline failed (exit {done.returncode}); no baseline in this run",
                  flush=True)
            return {"error": f"hf_baseline.py exited {done.returncode}"}
        return json.loads(Path(f.name).read_text())

def wait_for_baseline(path: Path, timeout_s: float = 900) -> dict:
    """The results of a baseline run started beside this one (``--baseline-from``)."""
    t = time.perf_counter()
    while not path.exists():
        if time.perf_counter() - t > timeout_s:
            raise TimeoutError(f"no baseline results at {path} after {timeout_s:.0f}s")
        time.sleep(2)
    return json.loads(path.read_text())  # whole: hf_baseline.py writes it by rename


def check_baseline(engine: Engine, name: str, reqs: list[Req], sample: list[dict]) -> dict:
    """The engine's results of a workload's first requests against the baseline's sample of
    the same cells (same weights): both bf16, so a few hundredths of a nat apart."""
    engine.reset_prefix_cache()
    _, _, res = run_engine(engine, reqs[:CHECK_REQUESTS], f"check-{name}")
    engine.reset_prefix_cache()
    out = compare(sample, [r.token_id_logprobs for r in res])
    print(f"{name}: engine vs transformers on {out['cells']} cells: max abs diff {out['max_abs_diff']:.4f}, "
          f"mean {out['mean_abs_diff']:.5f}", flush=True)
    return out


# --model-size: (config, checkpoint family name, written as safetensors (else the dummy load format))
MODELS = {"8b": (QWEN3_8B, "qwen3", True), "32b": (QWEN3_32B, "qwen3", False), "70b": (LLAMA33_70B, "llama3.3", False),
          "30b-a3b": (QWEN3_30B_A3B, "qwen3", False), "235b-a22b": (QWEN3_235B_A22B, "qwen3", False),
          "qwen3.5-9b": (QWEN3_5_9B, "qwen3_5", True), "qwen3.5-35b-a3b": (QWEN3_5_35B_A3B, "qwen3_5_moe", False),
          # latent attention and DeepSeekMoE: Moonlight-16B-A3B, and DeepSeek-V3's layers (7 of its 61)
          "moonlight": (MOONLIGHT_16B_A3B, "deepseek", False), "deepseek-v3-layers": (DEEPSEEK_V3_LAYERS, "deepseek", False),
          # sinks and windows, biased clamped-SwiGLU experts; Qwen3-Next's hybrid layers at 24 of its 48
          "gpt-oss-20b": (GPT_OSS_20B, "gpt_oss", False),
          "qwen3-next-80b-a3b": (QWEN3_NEXT_80B_A3B_LAYERS, "qwen3_next", False),
          # Gemma 3's local/global layers (all 62 of Gemma-3-27B's), GLM-4.5-Air's layers (18 of 46)
          "gemma3-27b": (GEMMA3_27B, "gemma3", False), "glm4.5-air": (GLM45_AIR_LAYERS, "glm4_moe", False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=list(MODELS), default="8b")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="pipeline stages the layers are split over (each --tensor-parallel-size GPUs)")
    ap.add_argument("--tp-comm-parts", type=int, default=None,
                    help="tp_comm_parts of the engine and the server (default: the config's)")
    ap.add_argument("--moe-parallel", choices=["tensor", "expert"], default=None,
                    help="moe_parallel of the engine and the server: how the tensor-parallel ranks split the expert "
                         "layers (default: the config's)")
    ap.add_argument("--workloads", default="W1,W1f,W3")
    ap.add_argument("--baseline", default="", help="workloads to also run through transformers")
    ap.add_argument("--baseline-layouts", default="auto",
                    help="the baseline's batch layouts (hf_baseline.py --layouts): e.g. 'padded,packed' times DESIGN's "
                         "left-padded recipe and, for hybrid models, the stronger packed one; ratios are given for each")
    ap.add_argument("--baseline-from", default="",
                    help="the baseline's results file (hf_baseline.py --out), written by a baseline run at the same "
                         "time on another GPU of this machine; read (waited for) before the engine's check against it")
    ap.add_argument("--checkpoint-only", action="store_true", help="write the checkpoint, then stop")
    ap.add_argument("--http", default="", help="workloads to also run through the HTTP server")
    ap.add_argument("--http-engine", default="default", type=_modes,
                    help="where the HTTP server runs its engine: its default (a process of its own on one GPU), on a "
                         "thread of its process, or in a process of its own (engine_process); several, comma-separated, "
                         "run one server after the other")
    ap.add_argument("--http-variants", default=[("", [])], type=_variants,
                    help="server settings to compare through HTTP, 'name=ARGS;name=ARGS' (e.g. "
                         "'slots4=--body-read-slots 4;slots0=--body-read-slots 0'): a server each, one after the other, "
                         "for each --http-engine mode")
    ap.add_argument("--prefix-cache-compare", default="", help="workloads to run with the prefix cache off and on")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", type=int, default=None,
                    help="max_num_batched_tokens (default: the engine's own, from the GPU's memory)")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--http-client", default=["httpx"], type=_clients,
                    help="the HTTP runs' clients, comma-separated: httpx, raw (asyncio streams, a fresh "
                         "connection per request); several alternate in each repeat, the first gives the headline")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--ckpt-dir", default="/tmp/ts-bench")
    ap.add_argument("--attention", default="auto", help="attention_backend of the engine")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="quantize the weights at load (the engine's and every server's; bench_fp8_e2e.py compares)")
    ap.add_argument("--fp8-block", action="store_true",
                    help="a block-wise FP8 checkpoint of the shape (DeepSeek's and Qwen's FP8 releases: 128 x 128 "
                         "weight blocks, 1 x 128 activation groups), dummy weights; no transformers baseline")
    ap.add_argument("--ablate", default="", help="workloads to rerun with one optimisation off at a time")
    ap.add_argument("--ablate-repeats", type=int, default=None, help="runs per ablation variant (default: --repeats)")
    ap.add_argument("--ablate-only", default="", help="variants of --ablate to run, in this order (default: all)")
    ap.add_argument("--profile", default="", help="workload to profile (first 24 requests): per-kernel CUDA time")
    ap.add_argument("--tiny", action="store_true", help="a small model of the family (CPU smoke runs)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the shape's first N layers (a shape that does not fit the GPU at its depth; stated in the results)")
    ap.add_argument("--step-trace", default="",
                    help="path prefix: the in-process engine's step trace goes to PREFIXengine.jsonl, each HTTP "
                         "server's to PREFIXhttp-NAME.jsonl (one JSON line per step, config step_trace)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = [v.split("#")[0] for v in args.ablate_only.split(",") if v and v.split("#")[0] not in ABLATIONS]
    if unknown:
        ap.error(f"--ablate-only: no variant {', '.join(unknown)} (the variants: {', '.join(ABLATIONS)})")
    global GPUS, TELEMETRY
    GPUS = args.tensor_parallel_size * args.pipeline_parallel_size
    if torch.cuda.is_available():
        # the server's compile cache, set before the baseline's process starts: its fla-core autotuning,
        # the engine's and the HTTP server's are then kept for the next run on this machine, as a
        # deployment keeps them across restarts (only start-up time changes, never a timed pass); not
        # where a server variant names its own (--compile-cache-dir: these variables would override it)
        if not any("--compile-cache-dir" in a for _, extra in args.http_variants for a in extra):
            use_compile_cache(None)
        TELEMETRY = GpuTelemetry.start(telemetry_indices(GPUS))
        print("GPU telemetry:", "nvidia-smi" if TELEMETRY else "unavailable", flush=True)
    cfg, family, written = MODELS[args.model_size]
    if args.tiny:  # the same path on a small model of the same family (CPU smoke runs)
        cfg = tiny(cfg)
    depth = cfg["num_hidden_layers"]
    if args.num_layers and args.num_layers != depth:
        cfg = with_layers(cfg, args.num_layers)
    if args.fp8_block:
        if args.quantization or args.baseline or args.baseline_from:
            ap.error("--fp8-block: a block-wise FP8 checkpoint, served as it is (no --quantization, no baseline)")
        # (the tiny shapes' widths are not whole 128-blocks: 16 x 16 blocks there)
        qc = dict(BLOCK_FP8_CONFIG, weight_block_size=[16, 16]) if args.tiny else BLOCK_FP8_CONFIG
        cfg, written = dict(cfg, quantization_config=qc), False
    names = [w for w in args.workloads.split(",") if w]
    base_names = [w for w in args.baseline.split(",") if w]
    http_names = [w for w in args.http.split(",") if w]
    ckpt = Path(args.ckpt_dir) / f"{family}-{args.model_size}"
    t = time.perf_counter()
    if args.tiny:
        ckpt = ckpt.with_name(ckpt.name + "-tiny")
    if cfg["num_hidden_layers"] != depth:
        ckpt = ckpt.with_name(f"{ckpt.name}-{cfg['num_hidden_layers']}layers")
    if args.fp8_block:
        ckpt = ckpt.with_name(ckpt.name + "-fp8-block")
    if written:
        write_random_checkpoint(ckpt, cfg)
        load_format = "auto"
    else:
        write_config(ckpt, cfg)
        load_format = "dummy"
    args.load_format = load_format
    print(f"checkpoint ready in {time.perf_counter() - t:.0f}s: {ckpt}", flush=True)
    if args.checkpoint_only:
        return
    abl_names = [w for w in args.ablate.split(",") if w]
    cmp_names = [w for w in args.prefix_cache_compare.split(",") if w]
    workloads = {n: make_workload(n, cfg["vocab_size"])
                 for n in set(names + base_names + http_names + abl_names + cmp_names)}
    max_len = max([args.max_model_len] + [len(r.tokens) for w in workloads.values() for r in w])
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "provenance": provenance(),
                     "model": f"{cfg['architectures'][0]} {args.model_size.upper()} shape, random bf16 weights "
                              f"({load_format} load)" + (f", quantized at load ({args.quantization})" if args.quantization else "")
                              + (f", as a block-wise FP8 checkpoint ({qc['weight_block_size']} blocks)" if args.fp8_block else "")
                              + (f", its first {cfg['num_hidden_layers']} of {depth} layers"
                                 if cfg["num_hidden_layers"] != depth else ""),
                     "num_layers": cfg["num_hidden_layers"],
                     "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
                     "budget_tokens": args.budget, "engine": {}, "baseline": {}, "http": {}, "prefix_cache": {}}
    base_runs = (run_baseline(ckpt, base_names, args.repeats, load_format == "dummy", args.baseline_layouts)
                 if base_names and not args.baseline_from else {})
    if "error" in base_runs:
        results["baseline_error"] = base_runs.pop("error")
    t = time.perf_counter()
    ecfg = Config(model=str(ckpt), load_format=load_format, max_num_batched_tokens=args.budget,
                  max_model_len=max_len, enable_prefix_caching=True, attention_backend=args.attention,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  quantization=args.quantization,
                  **({"tp_comm_parts": args.tp_comm_parts} if args.tp_comm_parts else {}),
                  **({"moe_parallel": args.moe_parallel} if args.moe_parallel else {}),
                  step_trace=f"{args.step_trace}engine.jsonl" if args.step_trace else None)
    engine = Engine(ecfg)
    results["engine_load_s"] = time.perf_counter() - t
    results["engine_warm_up_s"] = engine.warm_up_s  # part of the load: synthetic requests at start-up
    results["attention_backend"] = engine.tuning.attention.name
    results["budget_tokens"] = engine.tuning.token_budget  # the engine's choice where --budget is not given
    results["tp_comm_parts"] = engine.runner.tp.comm_parts
    results["moe_parallel"] = engine.runner.tp.moe
    blocks = engine.stats().kv_blocks_total
    # rank 0's cache as its model declares it (KV heads replicated past their count; hybrid models:
    # the full-attention layers only; pipeline parallel: its stage's layers)
    kv_bytes = blocks * ecfg.block_size * engine.runner.kv.layout.bytes_per_token()
    results["kv_pool_gib_per_gpu"] = kv_bytes / 2**30
    results["kv_pool_tokens"] = blocks * ecfg.block_size
    print(f"KV pool per GPU: {kv_bytes / 2**30:.1f} GiB, {blocks * ecfg.block_size} tokens", flush=True)
    layout = engine.model.linear_state_layout()
    if layout is not None:  # hybrid models: the linear layers' state slots beside the KV (the zero slot too)
        slots = engine.stats().state_slots_total
        results["linear_state_slots"] = slots
        results["linear_state_gib"] = (slots + 1) * layout.slot_bytes() / 2**30
        print(f"linear state: {slots} slots, {results['linear_state_gib']:.1f} GiB", flush=True)
    results["fused_stages_compiled"] = engine.fused_stages_compiled
    ops = getattr(getattr(engine, "runner", None), "ops", None)  # rank 0's switches after their start-up checks
    if ops is not None:
        results["kernels_on"] = {n: getattr(ops, n) for n in KERNEL_SWITCHES if n != "conv_kernel"}
    # the pool's sizes as the engine reports them (hybrid models: its linear-state slots too)
    results["engine_stats_at_start"] = {k: v for k, v in asdict(engine.stats()).items() if k != "timing"}
    print(f"engine loaded in {results['engine_load_s']:.0f}s, attention {engine.tuning.attention.name}", flush=True)
    cmp_names = [w for w in args.prefix_cache_compare.split(",") if w]
    for n in names + [w for w in cmp_names if w not in names]:
        if n in cmp_names:
            engine.tuning = replace(engine.tuning, prefix_caching=False)
            off = bench_engine(engine, cfg, n, workloads[n], args.repeats)
            engine.tuning = replace(engine.tuning, prefix_caching=True)
            on = bench_engine(engine, cfg, n, workloads[n], args.repeats)
            ideal = flop_ideal_speedup(cfg, workloads[n], ecfg.block_size)
            results["prefix_cache"][n] = {"off": off, "on": on, "speedup": off["seconds"] / on["seconds"],
                                          "flop_ideal_speedup": ideal,
                                          "of_flop_ideal": off["seconds"] / on["seconds"] / ideal}
            print(n, "cache off", f"{off['tokens_per_s']:.0f} tok/s", "on", f"{on['tokens_per_s']:.0f} tok/s",
                  f"x{off['seconds'] / on['seconds']:.2f} (FLOP ideal x{ideal:.2f})", flush=True)
        else:
            results["engine"][n] = bench_engine(engine, cfg, n, workloads[n], args.repeats)
            print(n, json.dumps(results["engine"][n]), flush=True)
    if args.baseline_from:  # the concurrent baseline on the other GPU (same host, same requests)
        try:
            base_runs = wait_for_baseline(Path(args.baseline_from))
            results["baseline_concurrent"] = ("transformers ran at the same time on another GPU of this machine "
                                              f"({args.baseline_from})")
        except TimeoutError as e:  # it failed: keep the engine's results
            print(f"no baseline: {e}", flush=True)
            results["baseline_concurrent"] = f"no results: {e}"
    results["baseline_check"] = {n: check_baseline(engine, n, workloads[workload_of(n)], b["check"])
                                 for n, b in base_runs.items() if b.get("check")}
    only = [v for v in args.ablate_only.split(",") if v]
    results["ablation"] = {n: ablate(engine, cfg, n, workloads[n], args.ablate_repeats or args.repeats, only)
                           for n in args.ablate.split(",") if n}
    if args.profile:
        try:  # a failed profile must not lose the runs before it
            results["profile"] = profile(engine, workloads.get(args.profile) or make_workload(args.profile, cfg["vocab_size"]),
                                         Path(args.out or "bench/results/x.json").with_suffix(".profile.txt"))
        except Exception as e:
            print(f"profile failed: {e!r}", flush=True)
            results["profile"] = {"error": repr(e)[:300]}
    engine.close()  # the tensor-parallel workers free their GPUs
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for mode in args.http_engine:
        for variant, extra in args.http_variants:
            for n in http_names:  # the server's default (as named), the engine on its thread, or in a process
                key = (n if mode == "default" else f"{n}-engine-{mode}") + (f"-{variant}" if variant else "")
                results["http"][key] = bench_http(ckpt, args, cfg, n, workloads[n], extra=extra, key=key,
                                                  engine_process=None if mode == "default" else mode == "process")
                print(key, "http", json.dumps(results["http"][key]), flush=True)
    for n, b in base_runs.items():
        results["baseline"][n] = summarize(n + "-transformers", cfg, workloads[workload_of(n)], b["seconds"],
                                           b["finish"], b["peak_bytes"], gpus=1)
        results["baseline"][n]["runs_seconds"] = b["runs_seconds"]
        if "clock" in b:  # its median run's power and clock (the telemetry ran beside it)
            gpu_window(results["baseline"][n], *b["clock"])
        if "packed" in b:  # hybrid models: which batch layout (see hf_baseline.resolve_layout)
            results["baseline"][n]["layout"] = "packed" if b["packed"] else "padded"
        print(n, "baseline", json.dumps(results["baseline"][n]), flush=True)
    tp = ((f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "")
          + (f"_pp{args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else ""))
    out = Path(args.out or f"bench/results/engine_{args.model_size}{tp}_h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if TELEMETRY is not None:
        results["gpu_telemetry"] = {"source": "nvidia-smi, every 50 ms", "gpus": TELEMETRY.static}
        TELEMETRY.close()
    results["summary"] = summary(results)
    out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(json.dumps(results["summary"], indent=1))


def provenance() -> dict:
    """What produced a results file: the code's commit (``git``, else ``TEACHER_SERVER_COMMIT``:
    a copy of the tree without its history), whether the tree had changes, the command line, and
    the versions of the libraries the numbers depend on."""
    import importlib.metadata as md

    root = Path(__file__).resolve().parents[1]

    def git(*a: str, env: dict | None = None) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10,
                                  check=True, env=env).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    tree = None
    if commit:  # the files as they ran, whatever HEAD says: a copied tree may carry an older .git
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "GIT_INDEX_FILE": f"{d}/index"}  # a fresh index: the work tree's files
            if git("add", "-A", env=env) is not None:
                tree = git("write-tree", env=env)
    versions = {}
    for dist in ("torch", "triton", "transformers", "numpy", "nvidia-cudnn-frontend", "fla-core", "flash-attn"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    if torch.backends.cudnn.is_available():
        versions["cudnn"] = torch.backends.cudnn.version()
    return {"commit": commit or os.environ.get("TEACHER_SERVER_COMMIT"),
            "tree_changed": bool(status) if status is not None else None,
            # git's tree id of the files that ran (tracked and untracked, not ignored): the commit
            # whose tree it is ran them (git log --all --format='%h %T' | grep TREE), when the
            # tree sent held no untracked scratch files (a carried baseline, .bench_base/, is ignored)
            "tree": tree,
            "argv": sys.argv, "versions": versions}


def workload_of(name: str) -> str:
    """The workload of a baseline's results key (``W1``, or ``W1@padded`` for another layout)."""
    return name.split("@")[0]


def summary(results: dict) -> dict:
    """The headline ratios: each workload against the transformers baseline of the same run
    (same requests; W2 with the prefix cache on, as served), and the prefix cache on vs off.
    A baseline of another batch layout (``W1@padded``) gives ``W1@padded_x_transformers``."""
    out = {}
    for n, base in results["baseline"].items():
        w = workload_of(n)
        ours = results["engine"].get(w) or results["prefix_cache"].get(w, {}).get("on")
        if ours:
            out[f"{n}_x_transformers"] = base["seconds"] / ours["seconds"]
            if ours["gpus"] > base["gpus"]:  # tensor parallel against the one-GPU baseline
                out[f"{n}_x_transformers_per_gpu"] = base["seconds"] / ours["seconds"] * base["gpus"] / ours["gpus"]
            out[f"{n}_mfu"] = ours["mfu"]
            out[f"{n}_transformers_mfu"] = base["mfu"]
    for n, d in results["prefix_cache"].items():
        out[f"{n}_prefix_cache_speedup"] = d["speedup"]
        out[f"{n}_prefix_cache_of_flop_ideal"] = d["of_flop_ideal"]
    return out


def profile(engine: Engine, reqs: list[Req], path: Path) -> list:
    """Per-kernel CUDA time over a few steps: where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    sub = reqs[:24]
    run_engine(engine, sub[:4], "prof-warm")
    engine.reset_prefix_cache()  # else the profiled run reuses the warm-up's prompts (prefixed chunks on varlen)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dt, _, _ = run_engine(engine, sub, "prof")
    engine.reset_prefix_cache()
    ka = prof.key_averages()
    table = ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    host = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)  # host-side cost
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n\nby host time:\n" + host + "\n\n" + layer_sequence(prof.events()))
    total = sum(e.self_device_time_total for e in ka) / 1e3
    top = sorted(ka, key=lambda e: -e.self_device_time_total)[:15]
    print(f"\nprofile: {dt:.2f}s wall, {total / 1e3:.2f}s of kernels")
    out = []
    for e in top:
        ms = e.self_device_time_total / 1e3
        print(f"  {ms:9.1f} ms {100 * ms / total:5.1f}%  x{e.count:<6d} {e.key[:90]}")
        out.append({"kernel": e.key[:200], "ms": ms, "count": e.count})
    return out


def layer_sequence(events: list, marker: str = "sdpa") -> str:
    """The kernels of one layer in the order the GPU ran them, with their times: from one
    attention kernel (a name holding ``marker``) to the next, the middle such span of the
    profile (a layer of a full step, usually), so a step's per-layer passes can be told apart."""
    kernels = sorted((e for e in events if e.device_type.name == "CUDA" and e.device_time > 0),
                     key=lambda e: e.time_range.start)
    marks = [i for i, e in enumerate(kernels) if marker in e.name]
    if len(marks) < 3:
        return f"layer sequence: fewer than 3 kernels named {marker!r}"
    mid = len(marks) // 2
    span = kernels[marks[mid]:marks[mid + 1]]
    lines = [f"one layer's kernels, in order (attention kernel {mid} of {len(marks)} to the next):"]
    lines += [f"{e.device_time:10.1f} us  {e.name[:110]}" for e in span]
    lines.append(f"{sum(e.device_time for e in span):10.1f} us  total; wall "
                 f"{kernels[marks[mid + 1]].time_range.start - span[0].time_range.start:.1f} us")
    return "\n".join(lines)


def print_table(results: dict) -> None:
    print(f"\n{'workload':<22}{'tok/s':>10}{'tok/s/GPU':>10}{'scored/s':>10}{'MFU/GPU':>8}{'x base':>8}{'peak GiB':>9}"
          f"{'p50 s':>8}{'p99 s':>8}{'W':>6}{'MHz':>6}{'MFU@clk':>8}")
    rows = [(k, v) for k, v in results["engine"].items()] + [(k + "-http", v) for k, v in results["http"].items()] + \
        [(k + "-transformers", v) for k, v in results["baseline"].items()]
    for k, d in results["prefix_cache"].items():
        rows += [(k + "-cache-off", d["off"]), (k + "-cache-on", d["on"])]
    for name, r in rows:
        base = results["baseline"].get(name.split("-")[0])
        ratio = f"{base['seconds'] / r['seconds']:.2f}" if base and not name.endswith("transformers") else ""
        per_gpu = r.get("tokens_per_s_per_gpu", r["tokens_per_s"])
        g = r.get("gpu") or {}
        print(f"{name:<22}{r['tokens_per_s']:>10.0f}{per_gpu:>10.0f}{r['scored_tokens_per_s']:>10.0f}{r['mfu']:>8.3f}{ratio:>8}"
              f"{r['peak_gib']:>9.1f}{r['latency_p50_s']:>8.2f}{r['latency_p99_s']:>8.2f}"
              f"{fmt(g.get('power_w_mean'), 6, 0)}{fmt(g.get('sm_mhz_mean'), 6, 0)}{fmt(r.get('mfu_at_clock'), 8, 3)}")


def fmt(v: float | None, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}f}" if v is not None else " " * width


if __name__ == "__main__":
    main()
