"""Build one attention step the way the model runner packs it: prefixed sequences first,
then fresh ones, each part longest first; packed [prefix | chunk] keys for the prefixed."""

from __future__ import annotations

import torch

from teacher_server.model.context import StepContext


def make_step(lens: list[tuple[int, int]], hq: int, hk: int, d: int, device: str, dtype: torch.dtype,
              seed: int = 0) -> tuple[tuple, StepContext, list[tuple[int, int]]]:
    """lens: (q_len, k_len) per sequence (k_len > q_len: prefixed). Returns
    ((q, k, v, kp, vp), ctx, ordered lens)."""
    order = sorted(lens, key=lambda t: (t[1] == t[0], -t[0]))
    npf = sum(1 for lq, lk in order if lk > lq)
    g = torch.Generator().manual_seed(seed)
    qs, ks, vs, kps, vps = [], [], [], [], []
    for i, (lq, lk) in enumerate(order):
        q, k, v = (torch.randn(lq, h, d, generator=g) for h in (hq, hk, hk))
        qs.append(q)
        ks.append(k)
        vs.append(v)
        if i < npf:
            kps.append(torch.cat([torch.randn(lk - lq, hk, d, generator=g), k]))
            vps.append(torch.cat([torch.randn(lk - lq, hk, d, generator=g), v]))
    cat = lambda xs: torch.cat(xs).to(device, dtype) if xs else None  # noqa: E731
    q_lens, k_lens = [t[0] for t in order], [t[1] for t in order]
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=device)  # noqa: E731
    z = torch.zeros(0, dtype=torch.int64, device=device)
    ctx = StepContext(z, z, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), q_lens, k_lens, None, None, None, None,
                      None, sum(k_lens[:npf]), z, npf, sum(q_lens[:npf]))
    return (cat(qs), cat(ks), cat(vs), cat(kps), cat(vps)), ctx, order


def reference(tensors: tuple, ctx: StepContext, scale: float, window: int | None) -> torch.Tensor:
    """The sdpa backend in float32 on the CPU, on the same step."""
    from teacher_server.model.attention import SdpaBackend

    cpu = tuple(None if t is None else t.float().cpu() for t in tensors)
    c = StepContext(*(getattr(ctx, f) for f in ("input_ids", "positions")), ctx.cu_q.cpu(), ctx.cu_k.cpu(),
                    ctx.max_q, ctx.max_k, ctx.q_lens, ctx.k_lens, None, None, None, None, None, ctx.total_k,
                    ctx.logits_idx, ctx.n_prefixed, ctx.tok_prefixed)
    return SdpaBackend()(*cpu, c, scale, window)
