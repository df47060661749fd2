"""The expert layer alone at the Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8,
expert intermediate 768), bf16, on the GPU: each stage timed with CUDA events (routing and
sort, the row gather, gate/up grouped GEMM, SiLU-mul, down grouped GEMM, the combine), the
grouped GEMMs' TFLOP/s against the H200's dense bf16 peak, the whole layer against the
padded-bmm fallback and against transformers' grouped-GEMM experts at the same weights.

  python bench/bench_moe.py --tokens 4096,16384,32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from teacher_server.layers.moe import SparseMoe
from teacher_server.layers.runtime import Runtime
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import GroupedGemm, padded_grouped_mm

PEAK = 989e12


def timed(fn, reps: int = 10) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn()`` over ``reps`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def transformers_block(moe: SparseMoe, h_: int, e_: int, k_: int, i_: int, dev: torch.device,
                       dt: torch.dtype) -> torch.nn.Module | None:
    """transformers' own Qwen3-MoE block with our layer's weights, its experts on grouped_mm."""
    try:
        import transformers as tf
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock,
        )

        cfg = tf.Qwen3MoeConfig(hidden_size=h_, num_experts=e_, num_experts_per_tok=k_, moe_intermediate_size=i_,
                                norm_topk_prob=True)
        cfg._experts_implementation = "grouped_mm"
        with torch.device(dev):
            block = Qwen3MoeSparseMoeBlock(cfg).to(dt).eval()
        with torch.no_grad():
            block.gate.weight.copy_(moe.gate.weight)
            block.experts.gate_up_proj.copy_(moe.experts.gate_up)
            block.experts.down_proj.copy_(moe.experts.down)
        return block
    except Exception as err:  # its module layout moves between versions
        print(f"transformers block not timed ({type(err).__name__}: {err})")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=768)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    h_, e_, k_, i_ = a.hidden, a.experts, a.top_k, a.intermediate
    gemm = GroupedGemm()
    moe = SparseMoe(h_, e_, k_, i_, True, 0, gemm, dt, dev)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    ops = FusedOps(kernels=True, compile=False)
    moe.bind(Runtime(None, ops, None, None))  # type: ignore[arg-type]
    print(f"torch grouped GEMM used: {gemm.use_torch(dev, dt, ((h_, 2 * i_), (i_, h_)))}")
    hf = transformers_block(moe, h_, e_, k_, i_, dev, dt)
    for t in [int(x) for x in a.tokens.split(",")]:
        h = torch.randn(t, h_, device=dev, dtype=dt)
        w, ids = moe.route(h)
        sorted_ids, order = torch.sort(ids.view(-1), stable=True)
        offs = torch.searchsorted(sorted_ids, moe.experts.expert_ends, out_int32=True)
        x = h.index_select(0, order // k_)
        gu = gemm(x, moe.experts.gate_up.transpose(1, 2), offs)
        act = ops.silu_mul(gu)
        y = gemm(act, moe.experts.down.transpose(1, 2), offs)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(t * k_, device=dev)
        stages = {
            "route+sort": lambda: torch.sort(moe.route(h)[1].view(-1), stable=True),
            "gather rows": lambda: h.index_select(0, order // k_),
            "gate/up gemm": lambda: gemm(x, moe.experts.gate_up.transpose(1, 2), offs),
            "silu_mul": lambda: ops.silu_mul(gu),
            "down gemm": lambda: gemm(act, moe.experts.down.transpose(1, 2), offs),
            "combine": lambda: F.embedding_bag(pos.view(t, k_), y, mode="sum", per_sample_weights=w.to(dt)),
        }
        ms = {n: timed(f) for n, f in stages.items()}
        whole = timed(lambda: moe(h))
        padded = timed(lambda: padded_grouped_mm(x, moe.experts.gate_up.transpose(1, 2), offs))
        fl_gu, fl_d = 2 * t * k_ * h_ * 2 * i_, 2 * t * k_ * i_ * h_
        print(f"T={t}: layer {whole:.3f} ms ({3 * fl_d / whole / 1e9 / PEAK * 1e3:.2f} of peak on expert FLOPs); "
              + ", ".join(f"{n} {v:.3f}" for n, v in ms.items())
              + f"; gate/up {fl_gu / ms['gate/up gemm'] / 1e9:.0f} TFLOP/s, down {fl_d / ms['down gemm'] / 1e9:.0f}"
              f" TFLOP/s; padded-bmm gate/up {padded:.3f} ms")
        if hf is not None:
            ms_hf = timed(lambda: hf(h[None]))
            print(f"  transformers Qwen3MoeSparseMoeBlock (grouped_mm experts, same weights): {ms_hf:.3f} ms "
                  f"(ours {ms_hf / whole:.2f}x faster)")

if __name__ == "__main__":
    main()
