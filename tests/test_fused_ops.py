"""FusedOps: our CUDA kernels and torch.compile are separate switches. A compile that fails
(when built, in the start-up check, or at run time) turns off the compiled stages alone; the
kernel switches stay on and every stage still equals its torch reference. Checked on the
CPU with kernel availability injected (each op takes its torch reference there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from teacher_server.cache_layout import CacheLayout
from teacher_server.kv_pool import KVPool
from teacher_server.layers.rotary import RotaryEmbedding
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.norm import add_rms_norm, rms_norm
from teacher_server.ops.qkv_rope import HeadLayout, qkv_prep
from teacher_server.ops.silu_mul import silu_mul_reference
from teacher_server.step_context import StepContext

HEADS = HeadLayout(n_q=4, n_kv=2, d=16, eps=1e-6)
HIDDEN, INTER, T = 32, 48, 10


def step(t: int, slots: list[int]) -> StepContext:
    """A fresh step of t tokens; token i writes pool slot slots[i] (-1: none)."""
    z = torch.zeros(0, dtype=torch.int64)
    tok = torch.tensor(slots, dtype=torch.int64)
    keep = tok >= 0
    cu = torch.tensor([0, t], dtype=torch.int32)
    return StepContext(input_ids=z, positions=torch.arange(t), cu_q=cu, cu_k=cu, max_q=t, max_k=t, q_lens=[t],
                       k_lens=[t], write_src=torch.arange(t)[keep], write_slots=tok[keep], new_pos=None,
                       prefix_pos=None, prefix_slots=None, total_k=0, logits_idx=z, tok_slots=tok)


def check_stages(ops: FusedOps) -> None:
    """Every stage of ops equals its torch reference, the KV-pool write included."""
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(T, HIDDEN, generator=g), torch.randn(T, HIDDEN, generator=g)
    w = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    for a, b in zip(ops.add_rms_norm(x, d, w, 1e-6), add_rms_norm(x, d, w, 1e-6)):
        torch.testing.assert_close(a, b)
    gu = torch.randn(T, 2 * INTER, generator=g)
    torch.testing.assert_close(ops.silu_mul(gu), silu_mul_reference(gu))
    # the gated norm of the linear layers, its gate a column slice (transformers' formula)
    o, wide, gw = torch.randn(T, 4, 32, generator=g), torch.randn(T, 160, generator=g), 1 + torch.randn(32, generator=g)
    z = wide[:, 16:144].view(T, 4, 32)
    torch.testing.assert_close(ops.gated_rms_norm(o, z, gw, 1e-6), rms_norm(o, gw, 1e-6) * F.silu(z))
    # the linear layers' input stage: q, k L2-normed per head (eps inside the root), v, each
    # contiguous, from the convolution's output; the gates from column slices
    nk, dk, nv, dv = 2, 16, 4, 8
    y, ba = torch.randn(T, 2 * nk * dk + nv * dv, generator=g), torch.randn(T, 2 * nv + 1, generator=g)
    b, a = ba[:, 1:1 + nv], ba[:, 1 + nv:]
    a_log, dt_bias = torch.randn(nv, generator=g), torch.randn(nv, generator=g)
    out = ops.linear_prep(y, b, a, a_log, dt_bias, nk, dk, nv, dv)
    heads = y[:, :2 * nk * dk].view(T, 2, nk, dk)
    normed = heads / (heads * heads).sum(-1, keepdim=True).add(1e-6).sqrt()
    want = (normed[:, 0], normed[:, 1], y[:, 2 * nk * dk:].view(T, nv, dv), torch.sigmoid(b),
            -a_log.exp() * F.softplus(a + dt_bias))
    for got, ref in zip(out, want, strict=True):
        assert got.is_contiguous() and got.shape == ref.shape
        torch.testing.assert_close(got, ref)
    rope = RotaryEmbedding(HEADS.d, 10000.0, {}, 64, 64, torch.device("cpu"))
    qkv = torch.randn(T, HEADS.width, generator=g)
    qn, kn = 1 + 0.1 * torch.randn(HEADS.d, generator=g), 1 + 0.1 * torch.randn(HEADS.d, generator=g)
    slots = [2 * i if i % 3 else -1 for i in range(T)]
    ctx = step(T, slots)
    pool = KVPool(2 * T, CacheLayout.uniform((0,), HEADS.n_kv, HEADS.d, torch.float32), torch.device("cpu"))
    pool.k_cache(0).zero_()
    pool.v_cache(0).zero_()
    cs = rope(ctx.positions)
    q, k, v = ops.qkv_store(qkv, cs, HEADS, qn, kn, pool, 0, ctx)
    h = HEADS.d // 2
    rq, rk, rv = qkv_prep(qkv, cs[:, None, :h], cs[:, None, h:], qn, kn, HEADS.n_q, HEADS.n_kv, HEADS.d, HEADS.eps)
    for a, b in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(a, b)
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(pool.k_cache(0)[s], rk[i]) and torch.equal(pool.v_cache(0)[s], rv[i])
    assert int((pool.k_cache(0).abs().sum((1, 2)) > 0).sum()) == sum(s >= 0 for s in slots)


def warm_up(ops: FusedOps) -> None:
    rope = RotaryEmbedding(HEADS.d, 10000.0, {}, 64, 64, torch.device("cpu"))
    ops.warm_up(HEADS, HIDDEN, INTER, torch.ones(HEADS.d), torch.ones(HEADS.d), rope.table, torch.device("cpu"),
                torch.float32)


def kernels_on(ops: FusedOps) -> bool:
    return ops.silu_kernel and ops.qkv_kernel and ops.residual_in_gemm


def test_compile_failing_at_build_keeps_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(*a, **kw):
        raise RuntimeError("no inductor here")

    monkeypatch.setattr(torch, "compile", no_compile)
    ops = FusedOps(kernels=True, compile=True, kernels_available=lambda: True)
    assert not ops.compiled and kernels_on(ops)
    warm_up(ops)
    assert not ops.compiled and kernels_on(ops)
    check_stages(ops)


def test_compiled_stage_failing_its_check_keeps_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile 'succeeds' with a wrong result: the start-up check turns the compiled
    stages off, and the stages are correct afterwards."""
    monkeypatch.setattr(torch, "compile", lambda f, **kw: lambda *a: torch.zeros(1) if f is rms_norm else f(*a))
    ops = FusedOps(kernels=True, compile=True, kernels_available=lambda: True)
    assert ops.compiled
    warm_up(ops)
    assert not ops.compiled and kernels_on(ops)
    check_stages(ops)


def test_warm_up_checks_the_linear_stage_at_the_layer_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the linear layers' heads set, the warm-up also checks the compiled input stage:
    a wrong one turns the compiled stages off; a right one keeps them."""
    from teacher_server.ops.gated_delta import linear_prep

    seen = []

    def wrong_linear(f, **kw):
        def run(*a):
            out = f(*a)
            if f is linear_prep:
                seen.append(a[0].shape)
                return (out[0] * 2, *out[1:])  # q off by a factor of two
            return out

        return run

    for compile_fn, stays in ((wrong_linear, False), (lambda f, **kw: f, True)):
        monkeypatch.setattr(torch, "compile", compile_fn)
        ops = FusedOps(kernels=False, compile=True)
        ops.linear_heads = (2, 16, 4, 8)
        warm_up(ops)
        assert ops.compiled is stays
        check_stages(ops)
    assert seen and seen[0][1] == 2 * 2 * 16 + 4 * 8  # called at the layer's width


def test_compile_failing_at_run_time_falls_back_per_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def flaky(f, **kw):
        def run(*a):
            calls.append(f.__name__)
            if len(calls) > 6:  # after the start-up check: a recompile that fails
                raise torch._dynamo.exc.TorchDynamoException("recompile limit")
            return f(*a)

        return run

    monkeypatch.setattr(torch, "compile", flaky)
    ops = FusedOps(kernels=True, compile=True, kernels_available=lambda: True)
    warm_up(ops)
    assert ops.compiled and kernels_on(ops)
    check_stages(ops)  # raises inside the compiled stages, answers from the eager ones
    assert len(calls) > 6 and kernels_on(ops)


def test_kernels_unavailable_leave_compile_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda f, **kw: f)
    ops = FusedOps(kernels=True, compile=True, kernels_available=lambda: False)
    assert ops.compiled and not ops.silu_kernel and not ops.qkv_kernel
    assert ops.residual_in_gemm  # a GEMM epilogue, not one of our kernels
    warm_up(ops)
    assert ops.compiled
    check_stages(ops)


def test_eager_ops_on_cpu() -> None:
    ops = FusedOps(kernels=False, compile=False)
    assert not (ops.compiled or ops.silu_kernel or ops.qkv_kernel or ops.residual_in_gemm)
    check_stages(ops)


def test_pool_gathers_prefix_and_chunk_keys() -> None:
    """Packed [prefix | chunk] keys: the prefix from pool slots, the chunk from this step's
    keys, in cu_k order; rows after them are zeroed slack."""
    pool = KVPool(16, CacheLayout.uniform((0, 1), 2, 4, torch.float32), torch.device("cpu"))
    for layer in range(2):
        pool.k_cache(layer).copy_(torch.randn(16, 2, 4))
        pool.v_cache(layer).copy_(torch.randn(16, 2, 4))
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    z = torch.zeros(0, dtype=torch.int64)
    # one prefixed sequence: 3 cached keys (slots 7, 2, 9) then its 5 queries' keys
    ctx = StepContext(input_ids=z, positions=z, cu_q=torch.tensor([0, 5]), cu_k=torch.tensor([0, 8]), max_q=5,
                      max_k=8, q_lens=[5], k_lens=[8], write_src=None, write_slots=None,
                      new_pos=torch.arange(3, 8), prefix_pos=torch.arange(3), prefix_slots=torch.tensor([7, 2, 9]),
                      total_k=8, logits_idx=z, n_prefixed=1, tok_prefixed=5)
    kp, vp = pool.gather_prefixed(1, k, v, ctx)
    assert torch.equal(kp[:3], pool.k_cache(1)[[7, 2, 9]]) and torch.equal(kp[3:], k)
    assert torch.equal(vp[:3], pool.v_cache(1)[[7, 2, 9]]) and torch.equal(vp[3:], v)
    slack = kp.untyped_storage().nbytes() // kp.element_size() - kp.numel()
    assert slack > 0 and torch.equal(kp.as_strided((slack,), (1,), kp.numel()), torch.zeros(slack))
    assert pool.nbytes == 2 * 2 * 16 * 2 * 4 * 4


def test_model_checks_ops_at_its_own_shapes(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 model (q/k norms) runs the start-up checks at its shapes; a failing compile
    leaves the kernel switches on."""
    from teacher_server.models.loader import load_model
    from teacher_server.models.spec import ModelSpec

    def no_compile(*a, **kw):
        raise RuntimeError("no inductor here")

    monkeypatch.setattr(torch, "compile", no_compile)
    path = checkpoints["qwen3"]
    spec = ModelSpec.from_dir(path)
    model = load_model(path, spec, torch.float32, torch.device("cpu"))
    ops = FusedOps(kernels=True, compile=True, kernels_available=lambda: True)
    model.warm_up_ops(ops, model.make_ropes(64, torch.device("cpu")))
    assert not ops.compiled and kernels_on(ops)
