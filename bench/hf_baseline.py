"""The side-by-side baseline: what trainers that host their teacher do today.

In-process transformers forward (bf16, sdpa), length-sorted left-padded batches of at most
32k padded tokens, ``logits_to_keep`` = longest response + 1, then
``log_softmax(logits.float()).gather(...)``."""

from __future__ import annotations

import time

import numpy as np
import torch
from workloads import Req


def batches(reqs: list[Req], max_padded: int = 32768) -> list[list[int]]:
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].tokens))
    out, cur = [], []
    for i in order:
        longest = max([len(reqs[j].tokens) for j in cur] + [len(reqs[i].tokens)])
        if cur and (len(cur) + 1) * longest > max_padded:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


@torch.inference_mode()
def run(model: torch.nn.Module, reqs: list[Req], keep_results: bool = False) -> tuple[float, list, list[float]]:
    """Returns (seconds, results or [], per-request finish times relative to start)."""
    dev = next(model.parameters()).device
    results: list = [None] * len(reqs)
    finish = [0.0] * len(reqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches(reqs):
        L = max(len(reqs[i].tokens) for i in b)
        keep = max(reqs[i].rows for i in b) + 1
        ids = np.zeros((len(b), L), dtype=np.int64)
        mask = np.zeros((len(b), L), dtype=np.int64)
        for row, i in enumerate(b):
            n = len(reqs[i].tokens)
            ids[row, L - n:] = reqs[i].tokens
            mask[row, L - n:] = 1
        ids_t = torch.from_numpy(ids).to(dev)
        mask_t = torch.from_numpy(mask).to(dev)
        pos = (mask_t.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos, logits_to_keep=keep).logits
        lp = torch.log_softmax(logits.float(), dim=-1)  # [B, keep, V]
        del logits
        for row, i in enumerate(b):
            r = reqs[i].rows
            # scored rows are the positions L-1-r .. L-2, i.e. keep-1-r .. keep-2 of the kept window
            cand = torch.from_numpy(reqs[i].cand.astype(np.int64)).to(dev)
            got = lp[row, keep - 1 - r:keep - 1].gather(-1, cand)
            results[i] = got.cpu().numpy() if keep_results else got
        del lp
        torch.cuda.synchronize()
        now = time.perf_counter() - t0
        for i in b:
            finish[i] = now
    torch.cuda.synchronize()
    return time.perf_counter() - t0, results if keep_results else [], finish
