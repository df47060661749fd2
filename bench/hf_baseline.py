"""The side-by-side baseline: what trainers that host their teacher do today, done well.

In-process transformers forward (bf16, sdpa), length-sorted left-padded batches of at most
32k padded tokens, ``logits_to_keep`` = longest response + 1, then
``log_softmax(logits.float()).gather(...)`` (docs/design.md, section 4).

What makes it the strong version of that recipe rather than a slow one:
- every batch's inputs (ids, mask, position ids) and its candidates, laid out as one
  ``[B, keep - 1, K]`` index tensor, are on the device before the clock starts, so the timed
  loop only launches work: one forward, one log_softmax and one gather per batch, no host to
  device copies, no per-request Python;
- no synchronisation per batch: the host queues batch i+1 while the GPU runs batch i; per
  request finish times come from a CUDA event recorded after each batch's gather;
- an untimed pass over the whole workload first, so every batch shape the timed runs meet has
  been compiled and tuned (fla-core's kernels autotune per shape bucket: with a two-request
  warm-up the first timed Qwen3.5-9B W1 run took 47.0 s against 21.0 s for the second);
- in that pass, a warm-up over the batch with the largest logits first (it sizes the caching allocator and
  selects the kernels) before timing;
- ``use_cache=False``: a prefill for scoring keeps no KV cache.
Left padding needs explicit position ids (each sequence's own 0..n-1): transformers derives
positions from the cache position otherwise, which shifts a padded sequence's positions.
It runs on CPU too (no CUDA calls there), which the tests use to check it against a float32
reference.

Hybrid models (Qwen3.5: Gated DeltaNet layers beside full attention) are packed by default
(``--layouts auto``), a stronger baseline than the recipe above; ``--layouts padded,packed``
times the recipe itself too, in the same process. Packed means no padding: each batch is one
row of its sequences back to back, up to the same 32k tokens
(``packed_batches``), and ``logits_to_keep`` is the index tensor of the scored rows. The
sequences are kept apart as transformers keeps packed sequences apart:
- full attention: the flash-attention-style packed arguments (``cu_seq_lens_q/k``,
  ``max_length_q/k``) reach the attention function, here torch's varlen FlashAttention-2
  (``packed_attention``; per segment SDPA on CPU), registered with transformers' attention
  interface;
- the gated delta rule: transformers passes ``cu_seq_lens_q`` to its kernel as ``cu_seqlens``,
  and fla-core's chunked kernel starts every segment from a zero state;
- the short causal convolution: transformers does not pass the boundaries to it (and its torch
  fallback could not take them), so each sequence is followed by ``conv_kernel - 1`` separator
  positions whose linear-layer input is zeroed (the recurrent-layer mask, 0 there). The next
  sequence's convolution then sees zeros before its first token, as it would alone; the
  separators end their segment, so whatever they compute stays there.
Without fla-core transformers' torch kernel cannot keep packed sequences apart (it ignores or
refuses ``cu_seqlens``), so ``run`` packs only when fla is importable, and otherwise uses the
left-padded batches, which are exact for these layers too (padding is zeroed before the
convolution, and a zero input leaves the zero state zero). A model loaded with the packed
attention implementation is run packed.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from workloads import Req


def batches(reqs: list[Req], max_padded: int = 32768) -> list[list[int]]:
    """Request indices in length-sorted batches of at most ``max_padded`` padded tokens
    (a single request longer than that is a batch of its own)."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].tokens))
    out, cur = [], []
    for i in order:
        # sorted: the request being added is the longest of the batch
        if cur and (len(cur) + 1) * len(reqs[i].tokens) > max_padded:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


@dataclass
class _Batch:
    """One batch, on the device: everything the timed loop reads."""

    members: list[int]  # request indices, in row order
    ids: torch.Tensor  # [B, L] int64, left-padded with 0
    mask: torch.Tensor  # [B, L] int64, 1 on real tokens
    pos: torch.Tensor  # [B, L] int64, each sequence's own positions (0 on padding)
    keep: int  # logits_to_keep = longest response + 1
    cand: torch.Tensor  # [B, keep - 1, K] int64: request b's rows right-aligned, 0 elsewhere
    pad: torch.Tensor | None  # [B, keep - 1, K] bool: -1 candidates (score -inf), None when there are none


def _prepare(reqs: list[Req], members: list[int], dev: torch.device) -> _Batch:
    """Host arrays for one batch, moved to ``dev`` once."""
    lens = [len(reqs[i].tokens) for i in members]
    big_l, keep = max(lens), max(reqs[i].rows for i in members) + 1
    k = reqs[members[0]].cand.shape[1]
    ids = np.zeros((len(members), big_l), dtype=np.int64)
    mask = np.zeros((len(members), big_l), dtype=np.int64)
    pos = np.zeros((len(members), big_l), dtype=np.int64)
    cand = np.zeros((len(members), keep - 1, k), dtype=np.int64)
    for row, (i, n) in enumerate(zip(members, lens)):
        r = reqs[i]
        assert r.cand.shape == (r.rows, k), (i, r.cand.shape, r.rows, k)
        ids[row, big_l - n:] = r.tokens
        mask[row, big_l - n:] = 1
        pos[row, big_l - n:] = np.arange(n)
        # Kept window row j is position big_l - keep + j, which predicts token big_l - keep + j + 1.
        # Request row t scores token start + t + 1 = n - rows + t, i.e. window row keep - 1 - rows + t.
        cand[row, keep - 1 - r.rows:] = r.cand
    neg = cand < 0
    pad = torch.from_numpy(neg).to(dev) if neg.any() else None
    return _Batch(members, *(torch.from_numpy(a).to(dev) for a in (ids, mask, pos)), keep,
                  torch.from_numpy(np.maximum(cand, 0)).to(dev), pad)


@dataclass
class _Packed:
    """One packed batch of a hybrid model, on the device."""

    members: list[int]  # request indices, in row order
    ids: torch.Tensor  # [1, T] int64: each sequence then its separators
    pos: torch.Tensor  # [1, T] int64: each sequence's own positions (separators continue them)
    mask: torch.Tensor  # [1, T] int64: 0 on separators (the linear layers' input is zeroed there)
    cu: torch.Tensor  # [N + 1] int32: segment (sequence + its separators) boundaries
    max_len: int  # longest segment
    keep: torch.Tensor  # [R] int64: positions of the scored rows (request order, row order)
    cand: torch.Tensor  # [R, K] int64
    pad: torch.Tensor | None  # [R, K] bool: -1 candidates, None when there are none
    row_starts: list[int]  # request b's rows are keep[row_starts[b]:row_starts[b + 1]]


def is_hybrid(model: torch.nn.Module) -> bool:
    """Whether the transformers model has linear-attention (Gated DeltaNet) layers."""
    return "linear_attention" in (getattr(model.config, "layer_types", None) or ())


def conv_separators(model: torch.nn.Module) -> int:
    """Separator positions after each packed sequence: the convolution's reach back."""
    return int(model.config.linear_conv_kernel_dim) - 1


def packed_batches(reqs: list[Req], sep: int, max_tokens: int = 32768) -> list[list[int]]:
    """Request indices in length-sorted packed batches of at most ``max_tokens`` positions
    (separators included; a single longer request is a batch of its own)."""
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].tokens))
    out, cur, used = [], [], 0
    for i in order:
        n = len(reqs[i].tokens) + sep
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def _prepare_packed(reqs: list[Req], members: list[int], sep: int, dev: torch.device) -> _Packed:
    """Host arrays for one packed batch, moved to ``dev`` once."""
    k = reqs[members[0]].cand.shape[1]
    ids, pos, mask, keep, cand, cu, row_starts = [], [], [], [], [], [0], [0]
    for i in members:
        r = reqs[i]
        n, off = len(r.tokens), cu[-1]
        assert r.cand.shape == (r.rows, k), (i, r.cand.shape, r.rows, k)
        ids += [r.tokens, np.zeros(sep, np.int64)]
        pos.append(np.arange(n + sep))
        mask += [np.ones(n, np.int64), np.zeros(sep, np.int64)]
        keep.append(off + r.start + np.arange(r.rows))  # row t predicts token start + t + 1
        cand.append(r.cand)
        cu.append(off + n + sep)
        row_starts.append(row_starts[-1] + r.rows)
    cand_a = np.concatenate(cand).astype(np.int64)
    neg = cand_a < 0
    lens = np.diff(cu)

    def to(a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

    return _Packed(members, to(np.concatenate(ids))[None], to(np.concatenate(pos))[None],
                   to(np.concatenate(mask))[None], to(np.asarray(cu), torch.int32), int(lens.max()),
                   to(np.concatenate(keep)), to(np.maximum(cand_a, 0)), to(neg, torch.bool) if neg.any() else None,
                   row_starts)


PACKED_ATTENTION = "packed_varlen"


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:  # noqa: ANN003
    """Causal attention within each packed segment (``cu_seq_lens_q``), for transformers'
    attention interface: ``query`` [1, H, T, D], ``key``/``value`` [1, Hkv, T, D] in, ``[1, T, H, D]``
    out. CUDA: torch's varlen FlashAttention-2, GQA native; CPU: SDPA per segment."""
    cu = kwargs["cu_seq_lens_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        m = int(kwargs["max_length_q"])
        # torch versions without the flag take fewer KV heads as they are
        flag = gqa and "enable_gqa" in inspect.signature(varlen_attn).parameters
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, m, m, scale=scaling,
                          window_size=(-1, 0), **({"enable_gqa": True} if flag else {}))
    else:
        bounds = cu.tolist()
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scaling, enable_gqa=gqa).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])])
    return out[None], None


def register_packed_attention() -> str:
    """Register ``packed_attention`` with transformers; returns its ``attn_implementation`` name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    return PACKED_ATTENTION


def _score_packed(model: torch.nn.Module, b: _Packed) -> torch.Tensor:
    """One packed batch: ``[R, K]`` float32 log-probs of the candidates."""
    logits = model(input_ids=b.ids, position_ids=b.pos, use_cache=False, logits_to_keep=b.keep,
                   # the masks given per layer type: none for full attention (the segments are its
                   # mask), the separators' zeros for the linear layers
                   attention_mask={"full_attention": None, "linear_attention": b.mask},
                   cu_seq_lens_q=b.cu, cu_seq_lens_k=b.cu, max_length_q=b.max_len, max_length_k=b.max_len).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V] float32
    del logits
    out = lp.gather(-1, b.cand)
    if b.pad is not None:
        out.masked_fill_(b.pad, float("-inf"))
    return out


def can_pack() -> bool:
    """Packing a hybrid model needs fla-core's kernel (see the module docstring)."""
    return importlib.util.find_spec("fla") is not None


def _score(model: torch.nn.Module, b: _Batch) -> torch.Tensor:
    """One batch: ``[B, keep - 1, K]`` float32 log-probs of the candidates."""
    logits = model(input_ids=b.ids, attention_mask=b.mask, position_ids=b.pos, logits_to_keep=b.keep,
                   use_cache=False).logits  # [B, keep, V]
    lp = torch.log_softmax(logits.float(), dim=-1)  # [B, keep, V] float32
    del logits
    out = lp[:, :-1].gather(-1, b.cand)  # the last kept row predicts past the sequence
    if b.pad is not None:
        out.masked_fill_(b.pad, float("-inf"))
    return out


@torch.inference_mode()
def run(model: torch.nn.Module, reqs: list[Req], keep_results: bool = False, warmup: bool = True,
        max_padded: int = 32768, pack: bool | None = None) -> tuple[float, list, list[float]]:
    """Score ``reqs``; returns (seconds, ``[rows, K]`` float32 numpy results in request order
    when ``keep_results`` else [], per-request finish times in seconds from the start).
    Preparing the batches and the warm-up come before the clock starts. ``pack``: packed
    batches (hybrid models; the model loaded with ``register_packed_attention()``'s
    implementation); None packs when the model was loaded with that implementation."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    packed_attn = model.config._attn_implementation == PACKED_ATTENTION
    if pack is None:
        pack = packed_attn
    if pack:
        assert packed_attn, model.config._attn_implementation
        sep = conv_separators(model) if is_hybrid(model) else 0
        plan = [_prepare_packed(reqs, m, sep, dev) for m in packed_batches(reqs, sep, max_padded)]
        score = _score_packed
        biggest = (lambda b: len(b.keep))  # noqa: E731
    else:
        plan = [_prepare(reqs, m, dev) for m in batches(reqs, max_padded)]
        score = _score
        biggest = (lambda b: len(b.members) * b.keep)  # noqa: E731
    if warmup and plan:
        score(model, max(plan, key=biggest))
    outs: list[torch.Tensor] = []
    marks: list = []  # per batch: a CUDA event, or the host time on CPU (where work is synchronous)
    if cuda:
        torch.cuda.synchronize(dev)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for b in plan:
        outs.append(score(model, b))
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    finish = [0.0] * len(reqs)
    results: list = [None] * len(reqs) if keep_results else []
    for b, out, mark in zip(plan, outs, marks):
        done = start.elapsed_time(mark) / 1e3 if cuda else mark
        for row, i in enumerate(b.members):
            finish[i] = done
            if keep_results:
                if pack:
                    results[i] = out[b.row_starts[row]:b.row_starts[row + 1]].cpu().numpy()
                else:
                    results[i] = out[row, b.keep - 1 - reqs[i].rows:].cpu().numpy()
    return seconds, results, finish


LAYOUTS = ("auto", "padded", "packed")


def resolve_layout(layout: str, cfg: dict) -> bool:
    """Whether ``layout`` packs this model's batches: ``padded`` is DESIGN's recipe (left-padded
    batches, sdpa), ``packed`` the stronger one for hybrid models (needs fla-core), ``auto`` the
    strongest there is (packed for a hybrid model when fla-core is importable)."""
    hybrid = "linear_attention" in (cfg.get("layer_types") or ())
    if layout == "padded":
        return False
    if layout == "packed":
        if not (hybrid and can_pack()):
            raise ValueError("the packed baseline is for hybrid (linear-attention) models with fla-core installed")
        return True
    if layout == "auto":
        return hybrid and can_pack()
    raise ValueError(f"unknown baseline layout {layout!r}; one of {', '.join(LAYOUTS)}")


# Families whose transformers model takes no sdpa: its fastest attention here (no hub kernels
# offline), on CUDA and on the CPU. gpt-oss: flex attention, which takes its sinks on CUDA (eager
# materialises every [L, L] score matrix); HF_BASELINE_ATTENTION overrides.
NO_SDPA = {"gpt_oss": ("flex_attention", "eager")}


def baseline_attention(cfg: dict) -> str:
    cuda_cpu = NO_SDPA.get(cfg.get("model_type", ""), ("sdpa", "sdpa"))
    return os.environ.get("HF_BASELINE_ATTENTION") or cuda_cpu[0 if torch.cuda.is_available() else 1]


def measure(ckpt: str, cfg: dict, names: list[str], repeats: int, dummy: bool,
            layouts: tuple[str, ...] = ("auto",)) -> dict:
    """Load the transformers model and time each workload ``repeats`` times after a warm-up;
    returns per workload the run times, the finish times of the median run and the peak memory.
    Several ``layouts`` run one after the other in this process (the model loaded again for
    each); the first one's results are under the workload's name, the others' under
    ``name@layout``."""
    import gc

    import transformers as tf
    from workloads import make_workload

    # MoE: transformers' grouped-GEMM experts (its fastest; the default on CUDA where it has them)
    kw = ({"experts_implementation": "grouped_mm"}
          if cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") else {})
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: smoke runs of the benchmark
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # (float32 there, as the engine's CPU runs)

    def load(attn: str, **kw) -> torch.nn.Module:  # noqa: ANN003
        if dummy:
            hcfg = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
            with torch.device(dev):
                return tf.AutoModelForCausalLM.from_config(hcfg, dtype=dtype, attn_implementation=attn, **kw)
        return tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn,
                                                       device_map=dev if dev == "cuda" else None, **kw)

    out = {}
    packs = [resolve_layout(lay, cfg) for lay in layouts]  # every layout checked before the first load
    for li, pack in enumerate(packs):
        # Hybrid (linear-attention) models are packed when fla-core is there (see the module docstring)
        attn = register_packed_attention() if pack else baseline_attention(cfg)
        print(f"transformers baseline: {'packed sequences, ' + attn if pack else 'left-padded batches, ' + attn}"
              f" attention; fla-core {'found' if can_pack() else 'not found'}", flush=True)
        try:
            model = load(attn, **kw)
        except (TypeError, ValueError) as e:  # a transformers without the switch: its default experts
            print(f"transformers experts_implementation not set ({e}); its default", flush=True)
            model = load(attn)
        print("transformers experts:", getattr(model.config, "_experts_implementation", None), flush=True)
        model.eval()
        for n in names:
            reqs = make_workload(n, cfg["vocab_size"])
            cap = fitting_batch(cfg, max(len(r.tokens) for r in reqs))
            run(model, reqs, max_padded=cap)  # untimed: every batch shape of the timed runs compiled and tuned
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs, clocks = [], []
            for _ in range(repeats):  # the pass above warmed up
                m0 = time.monotonic()  # the system's clock: the caller's GPU telemetry reads it too
                runs.append(run(model, reqs, warmup=False, max_padded=cap))
                clocks.append([m0, time.monotonic()])
            secs = [r[0] for r in runs]
            mid = sorted(range(repeats), key=lambda i: secs[i])[repeats // 2]
            key = n if li == 0 else f"{n}@{'packed' if pack else 'padded'}"
            out[key] = {"runs_seconds": secs, "seconds": secs[mid], "finish": runs[mid][2], "clock": clocks[mid],
                        "max_padded_tokens": cap,
                        "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else float("nan"),
                        "packed": pack}
            if not dummy:  # same weights as the engine's: a sample of cells to check it against
                out[key]["check"] = check_sample(model, reqs[:CHECK_REQUESTS])
            print(f"transformers {key}: {secs} s", flush=True)
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def fitting_batch(cfg: dict, longest: int, default: int = 32768) -> int:
    """Padded tokens per batch: DESIGN's 32,768, or fewer where a batch's [B, keep, V] logits (bf16,
    their float32 copy and its log-softmax: 10 bytes per row and vocab entry) would take more than
    60% of the GPU's free memory after the model (a large vocab beside large weights: Gemma-3-27B
    on an 80 GB card); whole requests of the longest length, at least one per batch."""
    if not torch.cuda.is_available():
        return default
    torch.cuda.empty_cache()  # an earlier workload's cached blocks are free for this one
    free = torch.cuda.mem_get_info()[0]
    fit = int(0.6 * free / (10 * cfg["vocab_size"]))
    cap = max(longest, min(default, fit // longest * longest))
    if cap < default:
        print(f"transformers batches: {cap} padded tokens (logits of {default} would not fit "
              f"{free / 2**30:.1f} GiB free)", flush=True)
    return cap


CHECK_REQUESTS = 2  # the first requests of a workload whose cells are compared with the engine's


def check_sample(model: torch.nn.Module, reqs: list[Req], stride: int = 37) -> list[dict]:
    """Every ``stride``-th row (and the last) of each request's ``[rows, K]`` result, to compare
    with the engine's on the same weights: ``[{"rows": [...], "values": [[...], ...]}]``."""
    _, results, _ = run(model, reqs, keep_results=True, warmup=False,
                        max_padded=fitting_batch(model.config.to_dict(), max(len(r.tokens) for r in reqs)))
    out = []
    for r, got in zip(reqs, results):
        rows = sorted(set(range(0, r.rows, stride)) | {r.rows - 1}) if r.rows else []
        out.append({"rows": rows, "values": got[rows].tolist()})
    return out


def compare(sample: list[dict], results: list[np.ndarray]) -> dict[str, float]:
    """Max and mean abs difference between a ``check_sample`` and another run's results of the
    same requests (both bf16: a few hundredths of a nat is bf16 rounding; a state or position
    error is tenths and more)."""
    diffs = np.concatenate([np.abs(np.asarray(s["values"], np.float64) - res[s["rows"]]).ravel()
                            for s, res in zip(sample, results) if s["rows"]])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()), "cells": int(diffs.size)}


def main() -> None:
    """``python bench/hf_baseline.py --ckpt DIR --workloads W1,W1f --repeats 3 --out F``: the
    baseline in a process of its own. The engine benchmark runs it so, before its engine is
    built: measured in the engine's process after the engine, the same baseline ran W1 12%
    slower (19.4k tok/s against 22.1k in a fresh process, H200)."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (its config.json is read)")
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dummy", action="store_true", help="random weights made in place from config.json")
    ap.add_argument("--layouts", default="auto",
                    help=f"batch layouts, comma-separated, run in turn ({', '.join(LAYOUTS)}; see resolve_layout)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(f"{a.ckpt}/config.json") as f:
        cfg = json.load(f)
    res = measure(a.ckpt, cfg, [w for w in a.workloads.split(",") if w], a.repeats, a.dummy,
                  tuple(x for x in a.layouts.split(",") if x))
    with open(a.out + ".part", "w") as f:  # renamed when whole: a run beside it waits for the file
        json.dump(res, f)
    os.replace(a.out + ".part", a.out)


if __name__ == "__main__":
    main()
