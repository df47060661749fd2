"""The scoring stage's cost per row, by target, on one step's worth of rows: the LM head's
float32 logits, then (a) the K-candidate gather kernel (the house path) or (b) the teacher's own
top-K (log normalizer + top-K over the vocabulary), with the top-K made several ways, so the
native top-K path's cost beside the candidate path is measured where it is spent.

  python bench/bench_scoring_topk.py --out bench/results/scoring_topk_h200.json     (H200: Qwen3-8B head)
  python bench/bench_scoring_topk.py --tiny                                           (CPU smoke)

Rows are scored in chunks of ``--chunk-rows`` as the engine does; CUDA events, median of
``--repeats`` after warm-up; random logits from a random head on random hidden states.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from teacher_server.engine.scoring import ScoringPlan, score_rows  # noqa: E402
from teacher_server.layers.embedding import VocabRows  # noqa: E402
from teacher_server.ops import top_k as fast  # noqa: E402


def _time(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def two_stage_topk(x: torch.Tensor, k: int, seg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per segment of ``seg`` columns, then top-k over the segments' winners."""
    p, v = x.shape
    n = v // seg
    head = x[:, :n * seg].view(p, n, seg)
    hv, hi = head.topk(k, dim=-1)  # [p, n, k]
    hi = hi + (torch.arange(n, device=x.device) * seg)[None, :, None]
    vals, ids = hv.reshape(p, -1), hi.reshape(p, -1)
    if v > n * seg:
        tv, ti = x[:, n * seg:].topk(min(k, v - n * seg), dim=-1)
        vals, ids = torch.cat([vals, tv], 1), torch.cat([ids, ti + n * seg], 1)
    bv, at = vals.topk(k, dim=-1)
    return bv, ids.gather(1, at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="scored rows in the step")
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.tiny:
        a.rows, a.chunk_rows, a.hidden, a.vocab, a.repeats = 64, 32, 64, 1000, 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    head = VocabRows(a.vocab, a.hidden, dt, dev)
    head.weight.data.normal_(0, 0.02, generator=g)
    h = torch.randn(a.rows, a.hidden, generator=g, device=dev).to(dt) * 3
    rows = torch.arange(a.rows, device=dev)
    cand = torch.randint(0, a.vocab, (a.rows, a.k), generator=g, device=dev)
    base = dict(cand=cand[:, :0], kmax=0, plp_rows=None, plp_actual=None, plp_k=0, argmax_rows=None)
    cand_plan = ScoringPlan(**{**base, "cand": cand, "kmax": a.k})
    topk_plan = ScoringPlan(**{**base, "plp_rows": rows, "plp_actual": cand[:, 0].contiguous(), "plp_k": a.k,
                               "plp_rows_host": rows.cpu().numpy(), "want_rank": False})
    # the same rows, every other one scored (a step with prompt rows between responses): a copy per chunk
    odd = torch.arange(0, a.rows, 2, device=dev)
    topk_odd = ScoringPlan(**{**base, "plp_rows": odd, "plp_actual": cand[odd, 0].contiguous(), "plp_k": a.k,
                              "plp_rows_host": odd.cpu().numpy(), "want_rank": False})
    res: dict[str, float] = {}

    def chunks(fn: Callable[[torch.Tensor], object]) -> None:
        for r0 in range(0, a.rows, a.chunk_rows):
            fn(head.logits(h[r0:r0 + a.chunk_rows]))

    res["head_logits"] = _time(lambda: chunks(lambda x: None), a.repeats, cuda)
    res["candidates_score_rows"] = _time(lambda: score_rows(h, head, cand_plan, False, a.chunk_rows), a.repeats, cuda)
    res["native_topk_score_rows"] = _time(lambda: score_rows(h, head, topk_plan, False, a.chunk_rows), a.repeats, cuda)
    res["native_topk_every_other_row"] = _time(lambda: score_rows(h, head, topk_odd, False, a.chunk_rows),
                                               a.repeats, cuda) * 2
    # the parts, each on the chunks' logits (head time included; subtract head_logits)
    from teacher_server.engine.scoring import _WholeVocab
    ops = _WholeVocab()
    res["head+normalizer"] = _time(lambda: chunks(ops.log_normalizer), a.repeats, cuda)
    res["head+topk_sorted"] = _time(lambda: chunks(lambda x: x.topk(a.k, dim=-1)), a.repeats, cuda)
    res["head+topk_unsorted"] = _time(lambda: chunks(lambda x: x.topk(a.k, dim=-1, sorted=False)), a.repeats, cuda)
    if fast.usable(h.new_empty(1, a.vocab, dtype=torch.float32), a.k):
        fast.prepare(a.vocab, dev)
        res["head+topk_kernel"] = _time(lambda: chunks(lambda x: fast.top_k_triton(x, a.k)), a.repeats, cuda)
        res["head+topk_bound_only"] = _time(lambda: chunks(lambda x: fast.bound(x, a.k)), a.repeats, cuda)
    for seg in (2048, 4096, 8192):
        if seg < a.vocab:
            res[f"head+topk_two_stage_{seg}"] = _time(lambda s=seg: chunks(lambda x: two_stage_topk(x, a.k, s)),
                                                      a.repeats, cuda)
    x = head.logits(h[:a.chunk_rows])
    ref_v, ref_i = x.topk(a.k, dim=-1)
    v2, i2 = two_stage_topk(x, a.k, 4096 if a.vocab > 4096 else 256)
    exact = bool(torch.equal(ref_v, v2))
    if fast.usable(x, a.k):
        kv, ki = fast.top_k_triton(x, a.k)
        exact = exact and bool(torch.equal(ref_v, kv)) and bool(torch.equal(x.gather(1, ki), kv))
    per_row = {k: v / a.rows * 1e6 for k, v in res.items()}
    over = {k: (v - res["head_logits"]) / a.rows * 1e6 for k, v in res.items() if k.startswith("head+")}
    print(f"{'case':34s} {'ms/step':>9s} {'us/row':>8s}")
    for k, v in res.items():
        print(f"{k:34s} {v * 1e3:9.2f} {per_row[k]:8.3f}")
    print("beyond the head's logits (us/row):", {k: round(v, 3) for k, v in over.items()})
    print("two-stage and kernel equal torch.topk:", exact)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "device": torch.cuda.get_device_name() if cuda else "cpu",
                                           "seconds": res, "us_per_row": per_row, "us_per_row_beyond_head": over,
                                           "two_stage_equal": exact}, indent=1))


if __name__ == "__main__":
    main()
