"""Build one attention step the way the model runner packs it: prefixed sequences first,
then fresh ones, each part longest first; packed [prefix | chunk] keys for the prefixed."""

from __future__ import annotations

import torch

from teacher_server.attention.base import AttentionInputs
from teacher_server.attention.cudnn import CudnnBackend
from teacher_server.attention.sdpa import SdpaBackend, sdpa_one
from teacher_server.step_context import StepContext


def make_step(lens: list[tuple[int, int]], hq: int, hk: int, d: int, device: str, dtype: torch.dtype,
              seed: int = 0,
              shared: list[int] | None = None) -> tuple[AttentionInputs, StepContext, list[tuple[int, int]]]:
    """lens: (q_len, k_len) per sequence (k_len > q_len: prefixed). Returns
    (inputs, ctx, ordered lens). With ``shared`` (per prefixed sequence, leading
    keys equal to the previous one's: ``StepContext.prefix_shared``) lens are taken in the
    given order, prefixed first."""
    order = list(lens) if shared is not None else sorted(lens, key=lambda t: (t[1] == t[0], -t[0]))
    npf = sum(1 for lq, lk in order if lk > lq)
    assert all(lk > lq for lq, lk in order[:npf])
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
            if shared is not None and shared[i]:
                kps[i][:shared[i]], vps[i][:shared[i]] = kps[i - 1][:shared[i]], vps[i - 1][:shared[i]]
    cat = lambda xs: torch.cat(xs).to(device, dtype) if xs else None  # noqa: E731
    q_lens, k_lens = [t[0] for t in order], [t[1] for t in order]
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=device)  # noqa: E731
    ctx = step_context(cu(q_lens), cu(k_lens), q_lens, k_lens, npf, shared)
    return AttentionInputs(cat(qs), cat(ks), cat(vs), cat(kps), cat(vps)), ctx, order


def step_context(cu_q: torch.Tensor, cu_k: torch.Tensor, q_lens: list[int], k_lens: list[int], npf: int,
                 shared: list[int] | None = None) -> StepContext:
    """The attention part of a StepContext (no token ids, KV writes or scored rows)."""
    z = torch.zeros(0, dtype=torch.int64, device=cu_q.device)
    return StepContext(input_ids=z, positions=z, cu_q=cu_q, cu_k=cu_k, max_q=max(q_lens), max_k=max(k_lens),
                       q_lens=q_lens, k_lens=k_lens, write_src=None, write_slots=None, new_pos=None, prefix_pos=None,
                       prefix_slots=None, total_k=sum(k_lens[:npf]), logits_idx=z, n_prefixed=npf,
                       tok_prefixed=sum(q_lens[:npf]), prefix_shared=shared)


def reference(x: AttentionInputs, ctx: StepContext, scale: float, window: int | None) -> torch.Tensor:
    """The sdpa backend in float32 on the CPU, on the same step."""
    cpu = AttentionInputs(*(None if t is None else t.float().cpu() for t in (x.q, x.k, x.v, x.kp, x.vp)))
    c = step_context(ctx.cu_q.cpu(), ctx.cu_k.cpu(), ctx.q_lens, ctx.k_lens, ctx.n_prefixed)
    return SdpaBackend()(cpu, c, scale, window)


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """[c, Hq, D] x [n, Hkv, D] -> (out [c, Hq, D], lse [Hq, c]); causal: top-left square."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("chd,nhd->hcn", q.float(), k.float().repeat_interleave(g, dim=1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hcn,nhd->chd", torch.softmax(s, dim=-1), v.float().repeat_interleave(g, dim=1))
    return o.to(q.dtype), lse


class CpuCudnn(CudnnBackend):
    """The cuDNN backend (plan, bucketed padding, prefix split, merge) with the device
    attention call replaced by float32 math. ``plans`` records each step's
    (prefix_shared, plan items). new_plans_per_step None (the default here): every cuDNN
    shape runs at once."""

    def __init__(self, min_len: int, new_plans_per_step: int | None = None, **settings) -> None:
        super().__init__(min_len, new_plans_per_step=new_plans_per_step, **settings)
        self.calls: list[str] = []
        self.plans: list[tuple[list[int], list]] = []

    def _plan(self, ctx, window):
        plan = super()._plan(ctx, window)
        self.plans.append((list(ctx.prefix_shared or []), plan.items))
        return plan

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window, softcap=None):
        self.calls.append("varlen")
        cq, ck = cu_q.tolist(), cu_k.tolist()
        assert cq[0] == 0 and ck[0] == 0 and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
        assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
        return torch.cat([sdpa_one(q[a:b], k[c:d], v[c:d], scale, window, softcap)
                          for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])])

    def _sdpa(self, q, k, v, causal, lse, scale):
        assert not causal or q.shape[0] == k.shape[0]  # causal calls are square
        self.calls.append(f"{'causal' if causal else 'full'}{q.shape[0]}x{k.shape[0]}")
        self.shapes.add((q.shape[0], k.shape[0], causal, lse))
        o, lse_ = partial(q, k, v, scale, causal)
        return o, (lse_ if lse else None)
