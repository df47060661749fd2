"""The packed attention backends' planning (which tokens and keys each call covers) and the
log-sum-exp merge, checked on the CPU: the cuDNN backend with its device calls replaced by
float32 math must equal the sdpa reference for mixed steps."""

from __future__ import annotations

import pytest
import torch

from attn_util import make_step, reference
from teacher_server.model import attention as A
from teacher_server.ops.elementwise import merge_attn


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):  # noqa: ANN202
    """[c, Hq, D] x [n, Hkv, D] -> (out [c, Hq, D], lse [Hq, c]); causal: top-left square."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("chd,nhd->hcn", q.float(), k.float().repeat_interleave(g, dim=1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hcn,nhd->chd", torch.softmax(s, dim=-1), v.float().repeat_interleave(g, dim=1))
    return o.to(q.dtype), lse


class CpuCudnn(A.CudnnBackend):
    """The cuDNN backend's plan with each device call done in float32 torch."""

    def __init__(self, min_len: int) -> None:
        super().__init__(min_len)
        self.calls: list[str] = []

    def _varlen_fn(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):  # noqa: ANN001, ANN202
        self.calls.append("varlen")
        cq, ck = cu_q.tolist(), cu_k.tolist()
        assert cq[0] == 0 and ck[0] == 0 and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
        assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
        return torch.cat([A._sdpa_one(q[a:b], k[c:d], v[c:d], scale, window)
                          for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])])

    def _dense(self, q, k, v, b, n, scale):  # noqa: ANN001, ANN202
        self.calls.append(f"dense{b}x{n}")
        return torch.cat([_partial(q[i * n:(i + 1) * n], k[i * n:(i + 1) * n], v[i * n:(i + 1) * n], scale, True)[0]
                          for i in range(b)])

    def _merged(self, q, kpre, vpre, kown, vown, scale, out):  # noqa: ANN001, ANN202
        self.calls.append(f"merged{q.shape[0]}+{kpre.shape[0]}")
        o1, l1 = _partial(q, kpre, vpre, scale, False)
        o2, l2 = _partial(q, kown, vown, scale, True)
        merge_attn(o1, l1, o2, l2, out)


CASES = {
    "mixed": [(40, 200), (300, 900), (8, 8), (64, 64), (64, 64), (100, 100), (3, 50)],
    "fresh_equal": [(64, 64)] * 4,
    "prefixed_only": [(32, 96), (16, 16 + 5)],
    "short_only": [(5, 5), (7, 20), (1, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("min_len", [16, 10_000])
def test_cudnn_plan_matches_reference(case: str, min_len: int) -> None:
    tensors, ctx, order = make_step(CASES[case], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(min_len)
    got = be(*tensors, ctx, 0.25, None)
    ref = reference(tensors, ctx, 0.25, None)
    assert (got - ref).abs().max().item() < 1e-5
    n_special = sum(1 for lq, _ in order if lq >= min_len)
    if min_len > 1000:
        assert all(c == "varlen" for c in be.calls)
    else:
        assert sum(c.startswith("merged") for c in be.calls) == sum(1 for lq, lk in order if lk > lq and lq >= min_len)
        assert n_special == 0 or any(c != "varlen" for c in be.calls)


def test_equal_lengths_are_one_dense_call() -> None:
    tensors, ctx, _ = make_step([(64, 64)] * 4 + [(32, 32)] * 2, 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(16)
    be(*tensors, ctx, 0.25, None)
    assert be.calls == ["dense4x64", "dense2x32"]


def test_sliding_window_stays_on_varlen() -> None:
    tensors, ctx, _ = make_step(CASES["mixed"], 4, 2, 16, "cpu", torch.float32)
    be = CpuCudnn(16)
    got = be(*tensors, ctx, 0.25, 24)
    assert set(be.calls) == {"varlen"}
    assert (got - reference(tensors, ctx, 0.25, 24)).abs().max().item() < 1e-5


def test_failed_path_is_switched_off_and_replanned() -> None:
    class Refusing(CpuCudnn):
        def _merged(self, *a):  # noqa: ANN002, ANN202
            raise RuntimeError("cuDNN: no engine for these shapes")

    tensors, ctx, _ = make_step(CASES["mixed"], 4, 2, 16, "cpu", torch.float32)
    be = Refusing(16)
    got = be(*tensors, ctx, 0.25, None)
    assert not be.merged and be.dense
    assert (got - reference(tensors, ctx, 0.25, None)).abs().max().item() < 1e-5


def test_merge_reference_equals_full_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(30, 4, 8, generator=g), torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g)
    o1, l1 = _partial(q, k[:20], v[:20], 0.3, False)
    o2, l2 = _partial(q, k[20:], v[20:], 0.3, False)
    full, _ = _partial(q, k, v, 0.3, False)
    out = torch.empty_like(q)
    merge_attn(o1, l1, o2, l2, out)
    assert (out - full).abs().max().item() < 1e-5
    # a row whose second part is empty (-inf) takes the first part alone
    l2[:, 0] = float("-inf")
    merge_attn(o1, l1, o2, l2, out)
    assert torch.allclose(out[0], o1[0], atol=1e-6)
