"""Bench one layer's attention of typical steps through the attention backends, as the
model runner packs them (Qwen3-8B heads: 32 query, 8 kv, head dim 128, bf16):

- ``w2_on``: a W2 step with the prefix cache on: 7 responses after one cached 2032-token
  prompt, beside a leader's last chunk and another group's first response;
- ``w2_off``: a W2 step with the cache off (4 whole sequences of 4095 tokens);
- ``grpo16``: 16 responses of 300..3000 tokens after one cached 1024-token prompt;
- ``w1``: a W1 step: whole sequences of W1's lengths (1280..6912 tokens) and the first chunk
  of the next, 16384 tokens, none prefixed;
- ``w1_cont``: the next kind of W1 step: the last 3000 tokens of a sequence split by the step
  before (2189 tokens of keys cached), then whole sequences;
- ``w3_fresh``, ``w3_cont``: W3's two kinds of step, a 32768-token sequence's first and second
  16384-token chunk.

Variants: the cuDNN backend as configured (one call for a group's queries against their
shared prompt), without grouping, without grouping on one stream, and torch varlen; on the
steps without prefixes also ``cudnn_ragged``: one cuDNN call over the packed sequences (THD
layout, cumulative lengths: no bucket padding), a candidate for replacing the bucketed
calls, timed in the same rotation only when its output matches the first variant's (when
cuDNN refuses the grouped kv heads or gets them wrong, the keys and values are expanded to the
query heads before timing, and the row says so); and ``cudnn_fe``: the same through cuDNN's
Python frontend (``nvidia-cudnn-frontend``, when installed), whose graphs are cached by the
bucketed longest length, so a call is not a plan build.
Also the gather of the prefixed sequences' cached keys from the pool. Reports milliseconds
per layer (median over interleaved rounds of each variant's median CUDA-event timing) and
useful TFLOP/s (causal work only).

    python bench/bench_attention.py [--out bench/results/attention_h200.json]
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
sys.path.insert(0, str(REPO / "bench"))

from bench_kernel import time_ms  # noqa: E402

from teacher_server.attention import AttentionInputs, make_backend  # noqa: E402
from teacher_server.ops.slack import alloc_with_slack  # noqa: E402
from teacher_server.step_context import StepContext  # noqa: E402

HQ, HK, D = 32, 8, 128
ROUNDS = 9
RAGGED_TOL = 0.05  # bf16 outputs of O(1): two correct kernels differ by about 1e-2 at most


def scenarios() -> dict[str, tuple[list[tuple[int, int]], list[int] | None]]:
    """name -> ((q_len, k_len) per sequence in step order, prefix_shared of the prefixed)."""
    w2 = [(85, 4095)] + [(2063, 4095)] * 7 + [(1858, 3890)]
    g = torch.Generator().manual_seed(0)
    resp = sorted((torch.randint(300, 3001, (16,), generator=g)).tolist(), reverse=True)
    return {
        "w2_on": (w2, [0, 0] + [2032] * 6 + [0]),
        "w2_off": ([(4095, 4095)] * 4 + [(4, 4)], None),
        "grpo16": ([(r, 1024 + r) for r in resp], [0] + [1024] * 15),
        "w1": (w1_step(), None),
        "w1_cont": ([(3000, 5189)] + w1_step(16384 - 3000), [0]),
        "w3_fresh": ([(16384, 16384)], None),
        "w3_cont": ([(16384, 32768)], [0]),
    }


def w1_step(budget: int = 16384) -> list[tuple[int, int]]:
    """Whole W1 sequences (prompt 256..1792 + response 1024..5120 tokens) in arrival order,
    then the first chunk of the next one up to the token budget."""
    g = torch.Generator().manual_seed(1)
    lens, total = [], 0
    while total < budget:
        n = int(torch.randint(256, 1793, (1,), generator=g)) + int(torch.randint(1024, 5121, (1,), generator=g))
        n = min(n, budget - total)
        lens.append((n, n))
        total += n
    return lens


def ragged_cudnn(tensors: AttentionInputs, ctx: StepContext, scale: float,
                 ref: torch.Tensor) -> tuple[Callable | None, dict]:
    """The step's attention as one cuDNN call on the packed [T, H, D] tensors with the
    cumulative query and key lengths (steps without prefixes only). Returns (the call, or
    None when cuDNN refuses it or its result differs from ``ref``, and how it ran): the kv
    heads as they are where that works, else expanded to the query heads (outside the call,
    so outside the timing)."""
    q, k, v = tensors.q, tensors.k, tensors.v
    cu_q, cu_k = ctx.cu_q, ctx.cu_k
    refused = []
    for expand in (False, True):
        kk, vv = (k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1)) if expand else (k, v)
        call = lambda kk=kk, vv=vv: torch.ops.aten._cudnn_attention_forward(  # noqa: E731
            q, kk, vv, None, cu_q, cu_k, ctx.max_q, ctx.max_k, False, 0.0, True, False, scale=scale)[0]
        try:  # the op's support for ragged GQA differs between torch/cuDNN versions
            diff = (call().float() - ref).abs().max().item()
        except Exception as e:
            refused.append(f"kv_expanded={expand}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            continue
        if diff <= RAGGED_TOL:
            return call, {"kv_expanded": expand, "max_abs_diff_vs_first": diff, "refused": refused}
        refused.append(f"kv_expanded={expand}: result differs by {diff:.3g}")
    return None, {"refused": refused}


def fe_attention(tensors: AttentionInputs, ctx: StepContext, scale: float,
                 ref: torch.Tensor) -> tuple[Callable | None, dict]:
    """The step's attention through cuDNN's Python frontend (``nvidia-cudnn-frontend``:
    ``torch.ops.cudnn.sdpa_fwd``) on the packed THD layout: one call for the fresh sequences
    over the step's keys, one for the prefixed ones over their packed keys (causal from the
    bottom right), each at the bucketed longest length with the real ones as cumulative
    lengths: no per-sequence padding, no output copy. Returns (the call, or None when the
    frontend is missing, refuses, or differs from ``ref``, and how it ran)."""
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd)
    except Exception as e:
        return None, {"refused": [f"no frontend: {type(e).__name__}: {e}"]}
    from teacher_server.attention.buckets import bucket

    npf, tp = ctx.n_prefixed, ctx.tok_prefixed
    dev = tensors.q.device
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=dev)  # noqa: E731
    calls = []
    if npf:
        qs, ks = ctx.q_lens[:npf], ctx.k_lens[:npf]
        calls.append((tensors.q[:tp], tensors.kp, tensors.vp, cu(qs), cu(ks), bucket(max(qs)), bucket(max(ks)), True))
    if npf < len(ctx.q_lens):
        qs = ctx.q_lens[npf:]
        calls.append((tensors.q[tp:], tensors.k[tp:], tensors.v[tp:], cu(qs), cu(qs), bucket(max(qs)), bucket(max(qs)),
                      False))

    def run() -> torch.Tensor:
        outs = [torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=True, causal_bottom_right=br, cu_seqlens_q=cq,
                                         cu_seqlens_kv=ck, max_seqlen_q=mq, max_seqlen_kv=mk, return_lse=False)[0]
                for q, k, v, cq, ck, mq, mk, br in calls]
        return outs[0] if len(outs) == 1 else outs

    try:
        out = run()
        out = out if isinstance(out, torch.Tensor) else torch.cat(out)
        diff = (out.float() - ref).abs().max().item()
    except Exception as e:
        return None, {"refused": [f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"]}
    if diff > RAGGED_TOL:
        return None, {"refused": [f"result differs by {diff:.3g}"]}
    return run, {"max_abs_diff_vs_first": diff, "calls": len(calls)}


def make(lens: list[tuple[int, int]], shared: list[int] | None) -> tuple[AttentionInputs, StepContext, float]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    npf = sum(1 for q, k in lens if k > q)
    q_lens, k_lens = [q for q, _ in lens], [k for _, k in lens]
    t, tk = sum(q_lens), sum(k_lens[:npf])
    like = torch.empty(0, device=dev, dtype=dt)
    q = alloc_with_slack(like, t, HQ, D, front=True).normal_()
    k, v = (alloc_with_slack(like, t, HK, D).normal_() for _ in range(2))
    kp, vp = (alloc_with_slack(like, tk, HK, D).normal_() for _ in range(2)) if npf else (None, None)
    off = 0
    for i in range(npf):  # shared leading keys are the same values, as pool entries are
        if shared is not None and shared[i]:
            prev = off - k_lens[i - 1]
            kp[off:off + shared[i]], vp[off:off + shared[i]] = kp[prev:prev + shared[i]], vp[prev:prev + shared[i]]
        off += k_lens[i]
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=dev)  # noqa: E731
    z = torch.zeros(0, dtype=torch.int64, device=dev)
    ctx = StepContext(input_ids=z, positions=z, cu_q=cu(q_lens), cu_k=cu(k_lens), max_q=max(q_lens),
                      max_k=max(k_lens), q_lens=q_lens, k_lens=k_lens, write_src=None, write_slots=None, new_pos=None,
                      prefix_pos=None, prefix_slots=None, total_k=tk, logits_idx=z, n_prefixed=npf,
                      tok_prefixed=sum(q_lens[:npf]), prefix_shared=shared)
    pairs = sum(c * (kl - c) + c * (c + 1) / 2 for c, kl in lens)
    return AttentionInputs(q, k, v, kp, vp), ctx, 4 * D * HQ * pairs


def gather_ms(lens: list[tuple[int, int]]) -> float:
    """kp[prefix_pos] = k_cache[prefix_slots] (and v) for the prefixed sequences' cached keys."""
    dev = torch.device("cuda")
    pool = torch.randn(200_000, HK, D, device=dev, dtype=torch.bfloat16)
    pos, slots, off = [], [], 0
    for c, kl in lens:
        if kl > c:
            pos.append(torch.arange(off, off + kl - c))
            slots.append(torch.randperm(200_000)[:kl - c])
            off += kl
    if not pos:
        return 0.0
    pos_d, slots_d = torch.cat(pos).to(dev), torch.cat(slots).to(dev)
    kp = torch.empty(off, HK, D, device=dev, dtype=torch.bfloat16)

    def run() -> None:
        kp[pos_d] = pool[slots_d]
        kp[pos_d] = pool[slots_d]

    return time_ms(run, 30, 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention_h200.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    # deterministic: every shape on cuDNN (plans built in the warm-up runs)
    cud = make_backend("cudnn", dev, deterministic=True)
    var = make_backend("varlen", dev)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": [HQ, HK, D],
                     "scenarios": {}}
    variants = {
        "cudnn": (cud, True, 3),
        "cudnn_ungrouped": (cud, False, 3),
        "cudnn_ungrouped_one_stream": (cud, False, 0),
        "varlen": (var, True, 3),
    }
    fes = {}
    for key, po, split in (("fe_backend", 4, True), ("fe_backend_nosplit", 4, False), ("fe_backend_po16", 16, False)):
        try:  # the engine backend; a lone prefixed sequence through the split or not; finer graph classes
            be = make_backend("cudnn_fe", dev)
        except Exception as e:
            print(f"cudnn_fe backend unavailable: {e}", flush=True)
            break
        be.per_octave = po
        be.split = be.split if split else None
        fes[key] = be
        variants[key] = (be, True, 0)
    for name, (lens, shared) in scenarios().items():
        tensors, ctx, flop = make(lens, shared)
        row = {"lens": lens, "gather_kv_ms": gather_ms(lens)}
        plans, ref = {}, None
        for v, (be, grouped, streams) in variants.items():  # each variant's plan and output
            be.group_prefixes, be.concurrent_streams = grouped, streams
            ctx.attn_plan = None
            out = be(tensors, ctx, D ** -0.5, None).float()
            ref = out if ref is None else ref
            plans[v] = ctx.attn_plan
            row[v] = {"items": sorted({type(it).__name__ for it in ctx.attn_plan.items}),
                      "max_abs_diff_vs_first": (out - ref).abs().max().item(), "round_ms": []}
        ragged, how = (None, {}) if ctx.n_prefixed else ragged_cudnn(tensors, ctx, D ** -0.5, ref)
        runs = {}  # variant -> one call of it, as timed
        for v, (be, grouped, streams) in variants.items():
            def run(be=be, grouped=grouped, streams=streams, plan=plans[v]) -> None:  # noqa: ANN001
                be.group_prefixes, be.concurrent_streams = grouped, streams
                ctx.attn_plan = plan
                be(tensors, ctx, D ** -0.5, None)

            runs[v] = run
        if ragged is not None:  # in the same rotation (its result matched the first variant's)
            row["cudnn_ragged"] = {**how, "round_ms": []}
            runs["cudnn_ragged"] = ragged
        elif how:
            row["cudnn_ragged"] = how
            print(f"{name:8s} cudnn_ragged not timed: {how['refused']}", flush=True)
        fe, how_fe = fe_attention(tensors, ctx, D ** -0.5, ref)
        if fe is not None:
            row["cudnn_fe"] = {**how_fe, "round_ms": []}
            runs["cudnn_fe"] = fe
        else:
            row["cudnn_fe"] = how_fe
            print(f"{name:8s} cudnn_fe not timed: {how_fe['refused']}", flush=True)
        names = list(runs)
        for r in range(ROUNDS):  # interleaved rounds, the order rotated: clocks and caches drift alike
            for v in names[r % len(names):] + names[:r % len(names)]:
                row[v]["round_ms"].append(time_ms(runs[v], 10, 2))
        for v in names:
            ms = statistics.median(row[v]["round_ms"])
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                runs[v]()
            host_ms = (time.perf_counter() - t) * 100  # per call: the launching thread's time
            torch.cuda.synchronize()
            row[v].update(ms=ms, tflops=flop / ms / 1e9, host_ms=host_ms)
            print(f"{name:8s} {v:28s} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s  host {host_ms:6.3f} ms  "
                  f"diff {row[v]['max_abs_diff_vs_first']:.3g}  {row[v].get('items', '')}", flush=True)
        print(f"{name:8s} {'gather cached k+v':28s} {row['gather_kv_ms']:7.3f} ms", flush=True)
        results["scenarios"][name] = row
    cud.group_prefixes, cud.concurrent_streams = True, 3
    results["fe_graph_builds_s"] = {k: be.builds for k, be in fes.items()}
    for k, be in fes.items():
        print(f"{k}: {len(be.builds)} graph builds, median {1e3 * statistics.median(be.builds or [0]):.0f} ms, "
              f"max {1e3 * max(be.builds or [0]):.0f} ms", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
