"""GPU checks of the engine pieces: attention backends against each other and the CPU
reference (causal with a cached prefix: queries shorter than keys), and the bf16 path
against transformers (the accuracy rule: mean abs error no larger than transformers' own bf16)."""

from __future__ import annotations

import pytest
import torch
from attn_util import make_step, reference

from teacher_server.attention import make_backend
from teacher_server.attention.cudnn import CudnnBackend

pytestmark = pytest.mark.gpu


MIXED = [(1, 1), (7, 50), (300, 300), (128, 1000), (1000, 1000), (400, 1400), (512, 512), (512, 512), (40, 40)]


def _backend(name: str):
    try:
        return make_backend(name, torch.device("cuda"))
    except Exception as e:  # flash-attn is optional (the Docker image has it)
        pytest.skip(f"{name} unavailable: {e}")


@pytest.mark.parametrize("backend", ["varlen", "flash_attn", "cudnn", "cudnn_fe"])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 128), (16, 4, 256)])
def test_backend_matches_reference(backend: str, window, heads) -> None:
    """Prefixed (queries shorter than keys) and fresh sequences, equal and unequal lengths,
    GQA and MHA, heads of 128 and of 256 (Qwen3.5's full-attention layers): every backend
    equals the float32 sdpa reference within bf16 rounding. The frontend backend serves the
    call itself (no fallback to the ``cudnn`` one)."""
    attn = _backend(backend)
    d = heads[2]
    tensors, ctx, _ = make_step(MIXED, *heads, "cuda", torch.bfloat16)
    got = attn(tensors, ctx, d ** -0.5, window).float().cpu()
    err = (got - reference(tensors, ctx, d ** -0.5, window)).abs().max().item()
    assert err < 2e-2, err
    if backend == "cudnn_fe" and window is None:
        assert attn.enabled and ctx.attn_plan.owner is attn


def test_cudnn_paths_are_taken() -> None:
    """On the H200 the cuDNN backend passes its self-check and serves long sequences; after
    the start-up warm-up every square (causal) shape it runs has a plan already."""
    attn = _backend("cudnn")
    assert isinstance(attn, CudnnBackend) and attn.enabled
    secs = attn.warm_up(4096, 8, 2, 128, torch.device("cuda"), torch.bfloat16)
    warmed = set(attn.shapes)
    print(f"cuDNN warm-up to 4096: {len(warmed)} shapes in {secs:.2f}s, native GQA {attn.native_gqa}")
    tensors, ctx, _ = make_step(MIXED, 8, 2, 128, "cuda", torch.bfloat16)
    got = attn(tensors, ctx, 128 ** -0.5, None).float().cpu()
    kinds = [type(it).__name__ for it in ctx.attn_plan.items]
    # the prefixed 400 after 1000 has a shape of its own: on varlen it costs microseconds more,
    # far less than its plan's build, so it is rented there; fresh squares are all built
    assert kinds.count("Prefixed") == 0 and kinds.count("Fresh") == 4, kinds
    assert (got - reference(tensors, ctx, 128 ** -0.5, None)).abs().max().item() < 2e-2
    attn.build_s, ctx.attn_plan = 0.0, None  # a build that costs nothing pays at once
    attn(tensors, ctx, 128 ** -0.5, None)
    kinds = [type(it).__name__ for it in ctx.attn_plan.items]
    # prefixed: 400 after 1000 (cuDNN), then 128 and 7 (varlen); fresh: 1000, 512 x 2, 300 (cuDNN), 40, 1 (varlen)
    assert kinds.count("Prefixed") == 1 and kinds.count("Fresh") == 4 and kinds.count("Varlen") == 2, kinds
    assert attn.enabled
    assert all(s in warmed for s in attn.shapes if s[2]), attn.shapes - warmed


def test_cudnn_prefix_group_matches_reference() -> None:
    """Three responses after one cached 2000-token prompt (one non-causal call for their
    queries against its first 1920 keys, a causal square each), a lone prefixed sequence
    and a fresh one: equal to the float32 reference, grouped or not."""
    attn = _backend("cudnn")
    lens = [(700, 2700), (650, 2650), (300, 2300), (400, 1400), (512, 512)]
    tensors, ctx, _ = make_step(lens, 8, 2, 128, "cuda", torch.bfloat16, shared=[0, 2000, 2000, 0])
    limit, attn.new_plans_per_step = attn.new_plans_per_step, None
    try:
        for grouped in (True, False):
            attn.group_prefixes, ctx.attn_plan = grouped, None
            got = attn(tensors, ctx, 128 ** -0.5, None).float().cpu()
            err = (got - reference(tensors, ctx, 128 ** -0.5, None)).abs().max().item()
            kinds = [type(it).__name__ for it in ctx.attn_plan.items]
            assert err < 2e-2, (grouped, err)
            assert kinds == (["Group", "Prefixed", "Fresh"] if grouped else ["Prefixed"] * 4 + ["Fresh"]), kinds
    finally:
        attn.new_plans_per_step, attn.group_prefixes = limit, True
    assert attn.enabled


def test_attention_items_on_side_streams_equal_one_stream() -> None:
    """A step's attention items run on side streams at once; each writes only its own rows,
    so the result is bitwise the one-stream result, also when the step runs on a non-default
    stream and is read right after."""
    attn = _backend("cudnn")
    tensors, ctx, _ = make_step(MIXED, 8, 2, 128, "cuda", torch.bfloat16)
    attn.concurrent_streams = 0
    one = attn(tensors, ctx, 128 ** -0.5, None).clone()
    attn.concurrent_streams = 3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            many = attn(tensors, ctx, 128 ** -0.5, None)
            assert torch.equal(many, one)
    assert len(ctx.attn_plan.items) > 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 333, 4096])
def test_silu_mul_kernel_matches_eager(dtype, rows: int) -> None:
    from teacher_server.ops import extension
    from teacher_server.ops.silu_mul import silu_mul, silu_mul_reference

    assert extension.available()
    x = torch.randn(rows, 2 * 1536, device="cuda", dtype=dtype) * 4
    got, ref = silu_mul(x), silu_mul_reference(x)
    assert got.dtype == dtype and got.shape == (rows, 1536)
    assert (got.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()
    assert (got == ref).float().mean().item() > 0.99  # same rounding points as eager torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_kernels_skip_the_rows_past_an_expert_parallel_row_end(dtype) -> None:
    """With a row end on the device (an expert-parallel rank's last row end), SiLU-mul and
    gpt-oss's clamped SwiGLU compute the rows before it as without one and neither read nor
    write the rows after it (NaN there in the input, a marker left in the output)."""
    from teacher_server.ops import extension
    from teacher_server.ops.clamped_swiglu import clamped_swiglu
    from teacher_server.ops.silu_mul import silu_mul_reference

    ext = extension.load()
    assert ext is not None
    m, inter, end = 333, 2880, 200
    at = torch.tensor([end], dtype=torch.int32, device="cuda")
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=dtype) * 4
    gu[end:] = float("nan")  # another rank's rows: whatever the grouped GEMM left there
    bias = torch.randn(8, 2 * inter, device="cuda", dtype=dtype)
    experts = torch.randint(0, 8, (m,), device="cuda")
    for name, run, ref in [
        ("silu_mul", lambda out: ext.silu_mul_out(gu, out, at), silu_mul_reference(gu[:end])),
        ("clamped_swiglu", lambda out: ext.clamped_swiglu_out(gu, bias, experts, 1.702, 7.0, out, at),
         clamped_swiglu(gu[:end], bias, experts[:end], 1.702, 7.0)),
    ]:
        out = torch.full((m, inter), -3.0, device="cuda", dtype=dtype)
        run(out)
        assert torch.isfinite(out).all(), name
        assert (out[end:] == -3.0).all(), name
        err = (out[:end].float() - ref.float()).abs().max().item()
        assert err <= 1e-2 * ref.float().abs().max().item(), (name, err)
        # rounded where eager torch rounds (SwiGLU: float32 in the same order, one rounding)
        assert (out[:end] == ref).float().mean().item() > 0.99, name
    # an end past the row count: every row written (NaN from NaN included); an end of 0: none
    for e, written in [(m + 5, m), (0, 0)]:
        out = torch.full((m, inter), -3.0, device="cuda", dtype=dtype)
        ext.silu_mul_out(gu, out, torch.tensor([e], dtype=torch.int32, device="cuda"))
        assert int((out != -3.0).any(dim=1).sum()) == written, e


def test_merge_attn_kernel_matches_reference() -> None:
    from teacher_server.ops.merge_attn import merge_attn, merge_attn_reference

    c, h, d = 300, 8, 128
    o1 = torch.randn(1, h, c, d, device="cuda", dtype=torch.bfloat16)[0].transpose(0, 1)  # [c, H, D] strided
    o2 = torch.randn(c, h, d, device="cuda", dtype=torch.bfloat16)
    l1 = torch.randn(h, c, device="cuda") * 5
    l2 = torch.randn(c, h, device="cuda").t() * 5  # strided [H, c]
    l2[0, :3] = float("-inf")
    out = torch.empty(c, h, d, device="cuda", dtype=torch.bfloat16)
    merge_attn(o1, l1, o2, l2, out)
    ref = merge_attn_reference(o1, l1, o2, l2)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert torch.equal(out[:3, 0], o1[:3, 0])


@pytest.mark.parametrize("d,norm,hq,hkv", [(128, True, 8, 2), (128, False, 8, 2), (64, True, 8, 2), (256, False, 8, 2),
                                           (128, True, 5, 1), (64, False, 6, 4), (128, True, 12, 2)])
def test_qkv_rope_kernel_matches_torch(d: int, norm: bool, hq: int, hkv: int) -> None:
    """Split + per-head norm + rotary + pool write in one kernel equals the torch stages,
    with the same bits whatever number of heads a lane group takes (7 heads: one each; 14:
    up to two; 16: up to eight)."""
    from teacher_server.ops.qkv_rope import HeadLayout, qkv_prep, qkv_rope

    torch.manual_seed(3)
    t, dt = 777, torch.bfloat16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=dt) * 3
    pos = torch.randint(0, 30000, (t,), device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = pos[:, None].float() * inv[None]
    cs = torch.cat([ang.cos(), ang.sin()], dim=1)  # [t, d]
    qn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dt) if norm else None
    kn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dt) if norm else None
    slots = torch.randperm(2 * t, device="cuda")[:t]
    slots[::5] = -1
    kc, vc = (torch.zeros(2 * t, hkv, d, device="cuda", dtype=dt) for _ in range(2))
    got = qkv_rope(qkv, cs, qn, kn, HeadLayout(hq, hkv, d, 1e-6), kc, vc, slots)
    assert got is not None
    for u in (1, 2, 8):
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        other = qkv_rope(qkv, cs, qn, kn, HeadLayout(hq, hkv, d, 1e-6), kc2, vc2, slots, items_per_group=u)
        assert all(torch.equal(a, b) for a, b in zip(got, other))
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    # The reference runs on the CPU: there rms_norm is the transformers formula (round the
    # normed value to bf16, then multiply by the weight), which the kernel follows.
    cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
    ref = qkv_prep(qkv.cpu(), cs[:, None, :d // 2].cpu(), cs[:, None, d // 2:].cpu(), cpu(qn), cpu(kn), hq, hkv, d,
                   1e-6)
    got_cpu = [g.cpu() for g in got]
    for g, r in zip(got_cpu, ref):
        assert g.shape == r.shape
        assert (g.float() - r.float()).abs().max().item() <= 2e-2 * r.float().abs().max().item()
        assert (g == r).float().mean().item() > 0.99
    keep = slots >= 0
    assert torch.equal(kc[slots[keep]], got[1][keep]) and torch.equal(vc[slots[keep]], got[2][keep])
    assert got[0].is_contiguous() and got[1].is_contiguous()
    written = torch.zeros(2 * t, dtype=torch.bool, device="cuda")
    written[slots[keep]] = True
    assert not kc[~written].any() and not vc[~written].any()  # nothing else in the pool touched


def test_cudnn_fe_lone_prefixed_sequence_takes_the_split_where_built() -> None:
    """The cudnn_fe backend: one prefixed sequence whose split shape is a one-off (not worth a
    build) takes a frontend call, as the fresh ones do; once its split plans are worth building
    (a build that costs nothing) it takes the cudnn backend's split; several prefixed sequences
    take a frontend call of their own. Each plan matches the reference."""
    from teacher_server.attention.cudnn_fe import FeCall

    attn = _backend("cudnn_fe")
    assert attn.split is not None and attn.enabled
    attn.warm_up(2048, 8, 2, 128, torch.device("cuda"), torch.bfloat16)  # the split's rent needs the sizes
    lone = [(600, 2000), (300, 300), (512, 512), (40, 40)]
    for lens, build_s, calls in ((lone, 1.0, 2), (lone, 0.0, 1), ([(600, 2000), (300, 900), (300, 300)], 0.0, 2)):
        attn.split.build_s = build_s
        tensors, ctx, _ = make_step(lens, 8, 2, 128, "cuda", torch.bfloat16)
        got = attn(tensors, ctx, 128 ** -0.5, None).float().cpu()
        kinds = [type(it).__name__ for it in ctx.attn_plan.items]
        assert sum(isinstance(it, FeCall) for it in ctx.attn_plan.items) == calls, kinds
        assert "Varlen" not in kinds, kinds
        assert (got - reference(tensors, ctx, 128 ** -0.5, None)).abs().max().item() < 2e-2
    assert attn.enabled
