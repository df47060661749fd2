"""Bench latent attention's attention call (q/k 192 wide, v 128) through each attention backend,
against the dense path at equal FLOPs (q/k/v 128), on a W1f-shaped step of fresh sequences
(4 x 4096 tokens, bf16) at Moonlight's 16 heads and DeepSeek-V3's 128:

- ``native``: v 128 as it is, where the backend takes values narrower than keys (checked
  against sdpa first; a backend that refuses or answers wrong is marked so);
- ``padded``: v zero-padded to 192 and the output's extra columns dropped (what the model does
  where the backend does not declare ``distinct_v_width``), the pad's copy included;
- ``dense128``: the same heads at q/k/v 128 (a Llama-style layer's call).

Useful FLOPs count the causal pairs once: 2 x (192 + 128) per pair and head for latent
attention, 2 x 256 for dense; the TFLOP/s of each variant and the ratio to dense128's say how
fast the wider keys run against the dense path at equal FLOPs.

    python bench/bench_mla_attention.py [--out bench/results/mla_attention_h200.json]
    python bench/bench_mla_attention.py --tiny        (CPU: sdpa at a small size, the path only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from teacher_server.attention import AttentionInputs, make_backend  # noqa: E402
from teacher_server.attention.sdpa import SdpaBackend  # noqa: E402
from teacher_server.step_context import StepContext  # noqa: E402

QK, V = 192, 128


def fresh_step(lens: list[int], dev: torch.device) -> StepContext:
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)
    t = sum(lens)
    zeros = torch.zeros(t, dtype=torch.long, device=dev)
    return StepContext(input_ids=zeros, positions=zeros, cu_q=cu, cu_k=cu, max_q=max(lens), max_k=max(lens),
                       q_lens=lens, k_lens=lens, logits_idx=zeros[:0])


def timed(fn: Callable[[], object], dev: torch.device, iters: int) -> float:
    """Median milliseconds of fn() (CUDA events; wall time on the CPU) after two warm-up calls."""
    for _ in range(2):
        fn()
    if dev.type != "cuda":
        runs = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t) * 1e3)
        return statistics.median(runs)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def bench_backend(name: str, heads: int, lens: list[int], dev: torch.device, dtype: torch.dtype,
                  iters: int) -> dict:
    b = make_backend(name, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    t = sum(lens)

    def rnd(d: int) -> torch.Tensor:
        return torch.randn(t, heads, d, device=dev, generator=g, dtype=dtype)

    q, k, v = rnd(QK), rnd(QK), rnd(V)
    q1, k1, v1 = rnd(V), rnd(V), rnd(V)
    pairs = sum(n * (n + 1) // 2 for n in lens) * heads
    mla_flops, dense_flops = pairs * 2 * (QK + V), pairs * 2 * (2 * V)
    scale = QK ** -0.5
    out: dict = {"backend": name, "heads": heads, "lens": lens, "distinct_v_width": b.distinct_v_width}

    def padded() -> torch.Tensor:
        vp = torch.zeros(t, heads, QK, device=dev, dtype=dtype)
        vp[..., :V] = v
        return b(AttentionInputs(q, k, vp), fresh_step(lens, dev), scale, None)[..., :V]

    def native() -> torch.Tensor:
        return b(AttentionInputs(q, k, v), fresh_step(lens, dev), scale, None)

    def dense() -> torch.Tensor:
        return b(AttentionInputs(q1, k1, v1), fresh_step(lens, dev), V ** -0.5, None)

    ref = SdpaBackend()(AttentionInputs(q[:lens[0]], k[:lens[0]], v[:lens[0]]), fresh_step(lens[:1], dev), scale,
                        None).float()
    try:
        got = native()[:lens[0]].float()
        err = float((got - ref).abs().max()) if got.shape == ref.shape else float("inf")
        out["native_max_abs_err"] = err
        out["native_ok"] = err < 2e-2
    except Exception as e:  # a refusal is this backend's answer
        out["native_ok"], out["native_error"] = False, f"{type(e).__name__}: {str(e)[:160]}"
    variants = {"padded": (padded, mla_flops), "dense128": (dense, dense_flops)}
    if out["native_ok"]:
        variants["native"] = (native, mla_flops)
    for var, (fn, flops) in variants.items():
        ms = timed(fn, dev, iters)
        out[var] = {"ms": ms, "tflops": flops / ms / 1e9}
    base = out["dense128"]["tflops"]
    for var in variants:
        out[var]["of_dense_rate"] = out[var]["tflops"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cudnn_fe,cudnn,flash_attn,varlen")
    ap.add_argument("--heads", default="16,128", help="query heads (= KV heads: latent attention expands per head)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU: sdpa on 2 x 64 tokens of 2 heads")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    backends = a.backends.split(",") if cuda else ["sdpa"]
    heads = [int(h) for h in a.heads.split(",")] if cuda else [2]
    lens = [4096] * 4 if cuda else [64, 64]
    rows = []
    for h in heads:
        for name in backends:
            try:
                r = bench_backend(name, h, lens, dev, dtype, a.iters if cuda else 2)
            except (ValueError, RuntimeError, ImportError) as e:
                print(f"{name}: unavailable ({e})", flush=True)
                continue
            rows.append(r)
            cells = "  ".join(f"{v} {r[v]['ms']:.3f} ms {r[v]['tflops']:.0f} TFLOP/s x{r[v]['of_dense_rate']:.2f}"
                              for v in ("native", "padded", "dense128") if v in r)
            print(f"heads {h:3d} {name:10s} native v128 {'ok' if r['native_ok'] else 'no'}: {cells}", flush=True)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
