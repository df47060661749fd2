"""What a new cuDNN attention shape costs: the first call of a shape builds its execution
plan on the launching thread; later calls reuse it. For each of ``--shapes`` random (queries,
keys) shapes of the non-causal call with log-sum-exp (the prefixed chunks' call), and of the
causal square: the first call's host time, then the mean of ``--iters`` later calls (host
time to launch, and GPU time).

  python bench/bench_cudnn_plans.py --heads 16 --kv-heads 4 --head-dim 256 --out plans.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, lse: bool) -> None:
    torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False, scale=q.shape[-1] ** -0.5)


def measure(hq: int, hkv: int, d: int, n: int, iters: int, causal: bool, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda")
    out = []
    for _ in range(n):
        cq = int(rng.integers(4, 64)) * 64
        ck = cq if causal else int(rng.integers(2, 64)) * 64
        q = torch.randn(1, hq, cq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, ck, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        torch.cuda.synchronize()
        t = time.perf_counter()
        call(q, k, v, causal, not causal)
        first_host = time.perf_counter() - t
        torch.cuda.synchronize()
        first_total = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(iters):
            call(q, k, v, causal, not causal)
        host = (time.perf_counter() - t) / iters
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / iters
        out.append({"queries": cq, "keys": ck, "first_call_host_ms": 1e3 * first_host,
                    "first_call_total_ms": 1e3 * first_total, "later_call_host_ms": 1e3 * host,
                    "later_call_total_ms": 1e3 * total})
        print(f"{'causal' if causal else 'prefix'} {cq}x{ck}: first call {1e3 * first_host:.1f} ms host "
              f"({1e3 * first_total:.1f} ms to done), later {1e3 * host:.3f} ms host, {1e3 * total:.3f} ms each",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--shapes", type=int, default=12)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="bench/results/cudnn_plans.json")
    a = ap.parse_args()
    call(*(torch.randn(1, h, 256, a.head_dim, device="cuda", dtype=torch.bfloat16) for h in (a.heads, a.kv_heads,
                                                                                           a.kv_heads)), True, False)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}
    for causal in (False, True):
        rows = measure(a.heads, a.kv_heads, a.head_dim, a.shapes, a.iters, causal, seed=int(causal))
        res["causal" if causal else "prefix"] = {
            "shapes": rows, "median_first_call_host_ms": float(np.median([r["first_call_host_ms"] for r in rows]))}
    print(json.dumps({k: v["median_first_call_host_ms"] for k, v in res.items() if isinstance(v, dict)}))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
