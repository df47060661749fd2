"""FP8 ops (``ops.fp8``, ``ops.fp8_quant``): the torch references on the CPU (round-trip error
bounds, scale layouts, zero rows, refused shapes), and on a Hopper GPU (marker ``gpu``) the
Triton quantization kernels against the references bit for bit (the fused norm within one e4m3
step) and torch's scaled multiplies against the dequantized float32 product."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interp import interpreted

from teacher_server.ops import fp8, fp8_block, fp8_grouped, fp8_mm, fp8_quant, fp8_silu_rows
from teacher_server.ops.guarded import FirstLaunch
from teacher_server.ops.norm import add_rms_norm, rms_norm
from teacher_server.ops.silu_mul import silu_mul_reference

E4M3_REL = 2.0 ** -4  # half a step of a 3-bit mantissa
E4M3_SUB = 2.0 ** -10  # half the subnormal step (2^-9) in units of the scale


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _within_e4m3(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> None:
    """Each dequantized value is x to within half an e4m3 step (relative, or subnormal absolute)."""
    s = scale.repeat_interleave(group, 1) if group else scale
    deq = xq.float() * s
    err = (deq - x.float()).abs()
    bound = E4M3_REL * x.float().abs() + E4M3_SUB * s * 1.0001
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


# ---------------------------------------------------------------- CPU: references


def test_rows_round_trip_and_scale() -> None:
    x = (torch.randn(37, 256, generator=_gen(0)) * torch.logspace(-3, 3, 37)[:, None]).bfloat16()
    xq, s = fp8.quantize_rows(x)
    assert xq.dtype == fp8.FP8 and xq.shape == x.shape and s.shape == (37, 1) and s.dtype == torch.float32
    assert torch.equal(s, x.float().abs().amax(1, keepdim=True) / fp8.FP8_MAX)
    assert torch.equal(xq.float().abs().amax(1), torch.full((37,), fp8.FP8_MAX))  # each row's amax maps to 448
    _within_e4m3(x, xq, s)


def test_zero_rows_get_zeros_and_a_finite_scale() -> None:
    x = torch.randn(4, 128, generator=_gen(1)).bfloat16()
    x[1] = 0
    for xq, s, g in (fp8.quantize_rows(x) + (None,), fp8.quantize_groups(x) + (128,)):
        assert torch.isfinite(s).all() and (s > 0).all()
        assert (xq[1].float() == 0).all()
        _within_e4m3(x, xq, s, g)


def test_groups_layout_values_and_refused_width() -> None:
    x = torch.randn(5, 384, generator=_gen(2)).bfloat16()
    x[:, 128:256] *= 100  # one group far larger: its own scale
    xq, s = fp8.quantize_groups(x)
    # M-major, as cuBLAS's 1x128 recipe reads it, in buffers of 8 rows (it takes M a multiple of 4)
    assert s.shape == (5, 3) and s.stride() == (1, 8) and xq.shape == (5, 384) and xq.stride() == (384, 1)
    assert xq.untyped_storage().nbytes() == 8 * 384 and s.untyped_storage().nbytes() == 4 * 8 * 3
    padding_codes = torch.empty(0, dtype=fp8.FP8).set_(xq.untyped_storage(), 0, (8, 384))[5:]
    assert (padding_codes.float() == 0).all()  # zero rows
    ref = x.float().view(5, 3, 128).abs().amax(-1) / fp8.FP8_MAX
    assert torch.equal(s, ref)
    _within_e4m3(x, xq, s, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_groups(torch.randn(2, 200).bfloat16())


def test_tensor_static_and_dynamic_saturate() -> None:
    x = torch.randn(8, 64, generator=_gen(3)).bfloat16()
    xq, s = fp8.quantize_tensor(x)
    assert s.shape == (1,) and torch.equal(s, x.float().abs().amax().reshape(1) / fp8.FP8_MAX)
    _within_e4m3(x, xq, s)
    static = torch.tensor([x.float().abs().max().item() / 896])  # half the range: values beyond 448 saturate
    xq, s = fp8.quantize_tensor(x, static)
    assert torch.equal(s, static) and not torch.isnan(xq.float()).any()
    assert xq.float().abs().max().item() == fp8.FP8_MAX


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["row", "group", "group_pow2"])
def test_fused_references_are_the_two_passes(wdtype: torch.dtype, mode: str) -> None:
    """On the CPU each fused op is exactly its two passes: the model's norm (or SiLU-mul), then
    the quantization."""
    x = torch.randn(6, 256, generator=_gen(4)).bfloat16()
    d = torch.randn(6, 256, generator=_gen(5)).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=_gen(6))).to(wdtype)
    q = fp8.quantize_rows if mode == "row" else lambda v: fp8.quantize_groups(v, pow2=mode == "group_pow2")
    for got, want in ((fp8.rms_norm_quant(x, w, 1e-6, mode), q(rms_norm(x, w, 1e-6))),
                      (fp8.silu_mul_quant(torch.cat([x, d], 1), mode), q(silu_mul_reference(torch.cat([x, d], 1))))):
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    s, xq, sc = fp8.add_rms_norm_quant(x, d, w, 1e-6, mode)
    s_ref, h = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, s_ref)
    assert torch.equal(xq.float(), q(h)[0].float()) and torch.equal(sc, q(h)[1])


def test_fused_tensor_mode_needs_a_static_scale() -> None:
    x = torch.randn(3, 128).bfloat16()
    static = torch.tensor([0.01])
    xq, s = fp8.rms_norm_quant(x, torch.ones(128).bfloat16(), 1e-6, "tensor", static)
    assert torch.equal(s, static)
    with pytest.raises(ValueError, match="static scale"):
        fp8.silu_mul_quant(torch.cat([x, x], 1), "tensor")
    with pytest.raises(ValueError, match="mode"):
        fp8.silu_mul_quant(torch.cat([x, x], 1), "block")
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.silu_mul_quant(torch.randn(3, 2 * 96).bfloat16(), "group")


def _weight_within_e4m3(w: torch.Tensor, wq: torch.Tensor, s: torch.Tensor, mode: str) -> None:
    scale_full = fp8.dequantize(torch.ones(wq.shape).to(fp8.FP8), s, mode)  # each weight's scale
    err = (fp8.dequantize(wq, s, mode) - w).abs()
    assert (err <= E4M3_REL * w.abs() + E4M3_SUB * scale_full * 1.0001).all()


@pytest.mark.parametrize("mode", fp8.MODES)
@pytest.mark.parametrize("n,k", [(256, 384), (200, 330)])  # the second: partial edge blocks
def test_weight_quantize_dequantize_round_trip(mode: str, n: int, k: int) -> None:
    w = torch.randn(n, k, generator=_gen(7)) * torch.logspace(-2, 2, n)[:, None]
    wq, s = fp8.quantize_weight(w, mode)
    assert s.shape == {"tensor": (1,), "row": (n, 1), "block": (-(-n // 128), -(-k // 128))}[mode]
    deq = fp8.dequantize(wq, s, mode)
    _weight_within_e4m3(w, wq, s, mode)
    if mode == "block":  # the padded layout dequantizes the same
        assert torch.equal(fp8.dequantize(wq, fp8.pad_block_scale(s), mode), deq)


def test_experts_quantize_per_expert() -> None:
    w = torch.randn(3, 32, 256, generator=_gen(8)) * torch.tensor([1.0, 10.0, 100.0])[:, None, None]
    for mode, shape in (("tensor", (3, 1, 1)), ("row", (3, 32, 1)), ("block", (3, 1, 2))):
        wq, s = fp8.quantize_weight(w, mode)
        assert s.shape == shape
        _weight_within_e4m3(w, wq, s, mode)


def test_block_scale_layout_for_cublas() -> None:
    """cuBLAS's 128x128 weight scales: [L4, Nb] with strides (1, L4), L4 = ceil(Kb / 4) * 4,
    holding ws[i, j] at [j, i] (PyTorch PR 166752): padded when Kb = 5, a view when Kb = 8."""
    for kb, l4 in ((5, 8), (8, 8)):
        ws = torch.rand(3, kb) + 0.5
        sb = fp8_block.block_scale_b(ws)
        assert sb.shape == (l4, 3) and sb.stride() == (1, l4)
        assert torch.equal(sb[:kb], ws.t())
        padded = fp8.pad_block_scale(ws)
        assert fp8_block.block_scale_b(padded).data_ptr() == padded.data_ptr()  # prepared at load: no copy


class _FakeCublas:
    """cuBLASLt's block recipe as its documentation states it (M and N multiples of 4, the
    1x128 scales M-major with column stride M), computing the dequantized product; refuses
    (CUBLAS_STATUS_NOT_SUPPORTED) a bias epilogue or everything when told to."""

    def __init__(self, wscale: torch.Tensor, refuse_bias: bool = False, refuse_all: bool = False) -> None:
        self.wscale, self.refuse_bias, self.refuse_all, self.calls = wscale, refuse_bias, refuse_all, []

    def __call__(self, xp, sp, wq, sb, out_dtype, bias):
        m, kb = sp.shape
        self.calls.append((xp.data_ptr(), m, out_dtype, bias is not None))
        assert m % 4 == 0 and wq.shape[0] % 4 == 0 and xp.shape[0] == m
        assert sp.stride(0) == 1 and (sp.stride(1) == m or kb == 1)
        if self.refuse_all or (self.refuse_bias and bias is not None):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`")
        return fp8.scaled_linear_reference(xp, sp, wq, self.wscale, "block", out_dtype, bias)


@pytest.mark.parametrize("t", [77, 1, 80])
def test_block_multiply_pads_rows_for_cublas_and_falls_back(monkeypatch, t: int) -> None:
    """The block path hands cuBLASLt a multiple of 4 rows (quantize_groups' padded buffers as
    they are, other layouts copied), keeps the first T rows of its output, adds a bias before
    the one rounding where the epilogue is refused, and runs the dequantized product where the
    whole recipe is refused (no Triton on the CPU); each refusal is remembered."""
    monkeypatch.setattr(fp8_mm, "_cc", lambda x: (9, 0))
    monkeypatch.setattr(fp8_block, "_REFUSED", set())
    x, _, xq, xs, wq, ws = _operands(t, 640, 336, "block")
    bias = torch.randn(336, generator=_gen(11)).bfloat16()
    xp, sp = fp8_block.pad_rows(xq, xs, -(-t // 4) * 4)  # the references over the same rows (the CPU's sums)
    ref = fp8.scaled_linear_reference(xp, sp, wq, ws, "block", torch.float32, bias)[:t]
    ref0 = fp8.scaled_linear_reference(xp, sp, wq, ws, "block", torch.float32)[:t]
    fake = _FakeCublas(ws)
    monkeypatch.setattr(fp8_block, "_cublas_block", fake)
    y = fp8_mm._block_mm(xq, xs, wq, ws, torch.bfloat16, bias)
    assert y.shape == (t, 336) and torch.equal(y, ref.bfloat16())
    assert fake.calls == [(xq.data_ptr(), -(-t // 4) * 4, torch.bfloat16, True)]  # in place: no copy
    y = fp8_mm._block_mm(xq.clone(), xs.t().contiguous().t(), wq, ws, torch.bfloat16, None)  # unpadded: copied
    assert fake.calls[-1][0] != xq.data_ptr() and torch.equal(y, ref0.bfloat16())
    fake = _FakeCublas(ws, refuse_bias=True)
    monkeypatch.setattr(fp8_block, "_cublas_block", fake)
    for _ in range(2):
        y = fp8_mm._block_mm(xq, xs, wq, ws, torch.bfloat16, bias)
        assert torch.equal(y, ref.bfloat16())  # rounded once
    assert [c[2:] for c in fake.calls] == [(torch.bfloat16, True), (torch.float32, False), (torch.float32, False)]
    fake = _FakeCublas(ws, refuse_all=True)
    monkeypatch.setattr(fp8_block, "_cublas_block", fake)
    for _ in range(2):
        y = fp8_mm._block_mm(xq, xs, wq, ws, torch.float32, None)
        assert torch.equal(y, fp8.scaled_linear_reference(xq, xs, wq, ws, "block", torch.float32))
    assert len(fake.calls) == 1
    if t > 1:
        with pytest.raises(ValueError, match="M-major"):
            fp8_mm._block_mm(xq, xs.contiguous(), wq, ws, torch.bfloat16, None)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "ScalingType"), reason="torch without F.scaled_mm")
@pytest.mark.parametrize("t,k,n", [(77, 640, 384), (1, 128, 128), (1000, 4096, 1024)])
def test_layouts_pass_torchs_own_shape_checks(t: int, k: int, n: int) -> None:
    """The scales as the wrappers hand them to torch (quantize_groups' M-major activation scales,
    the padded 128x128 weight scales, [T, 1] x [1, N] rows, [M] x [E, N] for the experts) pass
    torch's shape and stride checks (its meta functions, on the 'meta' device)."""
    F, meta = torch.nn.functional, "meta"
    xq, wq = (torch.empty(*s, device=meta, dtype=fp8.FP8) for s in ((t, k), (n, k)))
    kb, nb = -(-k // 128), -(-n // 128)
    xs = torch.empty(kb, t, device=meta).t()  # quantize_groups' layout
    sb = fp8_block.block_scale_b(torch.empty(nb, kb, device=meta))
    y = F.scaled_mm(xq, wq.t(), xs, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    assert y.shape == (t, n)
    sa, sr = torch.empty(t, 1, device=meta), torch.empty(n, 1, device=meta).t()
    assert torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sr, out_dtype=torch.bfloat16).shape == (t, n)
    e = 6
    y = torch._scaled_grouped_mm(xq, torch.empty(e, n, k, device=meta, dtype=fp8.FP8).transpose(1, 2),
                                 torch.empty(t, device=meta), torch.empty(e, n, device=meta),
                                 offs=torch.empty(e, device=meta, dtype=torch.int32), out_dtype=torch.bfloat16)
    assert y.shape == (t, n)


def _operands(t: int, k: int, n: int, mode: str, seed: int = 9):
    g = _gen(seed)
    x = torch.randn(t, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * k ** -0.5
    wq, ws = fp8.quantize_weight(w, mode)
    xq, xs = {"tensor": fp8.quantize_tensor, "row": fp8.quantize_rows, "block": fp8.quantize_groups}[mode](x)
    return x, w, xq, xs, wq, ws


@pytest.mark.parametrize("mode", fp8.MODES)
def test_scaled_linear_cpu_is_the_dequantized_product(mode: str) -> None:
    x, w, xq, xs, wq, ws = _operands(9, 256, 64, mode)
    bias = torch.randn(64).bfloat16()
    y = fp8.scaled_linear(xq, xs, wq, ws, mode, torch.float32, bias=bias)
    ref = (xq.float() * (xs.repeat_interleave(128, 1) if mode == "block" else xs)) @ fp8.dequantize(wq, ws, mode).t()
    assert y.dtype == torch.float32 and torch.allclose(y, ref + bias.float(), atol=1e-5, rtol=1e-5)
    exact = x.float() @ w.t()  # FP8 error on both operands: a few percent of the output's size
    assert (y - bias.float() - exact).abs().max() <= 0.1 * exact.abs().max()
    out = torch.empty(9, 64, dtype=torch.bfloat16)
    assert fp8.scaled_linear(xq, xs, wq, ws, mode, torch.bfloat16, out=out) is out


def test_scaled_linear_mixed_tensor_and_row_and_bad_inputs() -> None:
    _, _, xq, _, wq, ws = _operands(4, 128, 32, "row")
    xs = torch.tensor([0.02])
    y = fp8.scaled_linear(xq, xs, wq, ws, "row", torch.float32)
    assert torch.allclose(y, (xq.float() * 0.02) @ fp8.dequantize(wq, ws, "row").t(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        fp8.scaled_linear(xq, xs, wq, ws, "channel")
    with pytest.raises(ValueError, match=r"\[T, K\] and w \[N, K\]"):
        fp8.scaled_linear(xq, xs, wq[:, :64], ws, "row")
    with pytest.raises(ValueError, match="e4m3"):
        fp8.scaled_linear(xq.float(), xs, wq, ws, "row")


def _grouped(counts: list[int], k: int = 128, n: int = 64, seed: int = 10):
    g = _gen(seed)
    m, e = sum(counts), len(counts)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(e, n, k, generator=g) * k ** -0.5
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, offs


def test_grouped_cpu_is_each_experts_product() -> None:
    counts = [3, 0, 7, 1, 0, 5]
    x, w, offs = _grouped(counts)
    wq, ws = fp8.quantize_weight(w, "row")
    xq, xs = fp8.quantize_rows(x)
    y = fp8.grouped_scaled_linear(xq, xs, wq, ws, offs)
    start = 0
    for i, c in enumerate(counts):
        want = fp8.scaled_linear_reference(xq[start:start + c], xs[start:start + c], wq[i], ws[i], "row")
        assert torch.equal(y[start:start + c], want)
        start += c
    wq_t, ws_t = fp8.quantize_weight(w, "tensor")  # one scale per expert: [E, 1, 1]
    y_t = fp8.grouped_scaled_linear(xq, xs, wq_t, ws_t, offs)
    assert torch.equal(y_t, fp8.grouped_scaled_linear_reference(xq, xs, wq_t, ws_t, offs, "tensor"))


def test_grouped_block_scales_and_block_to_rows() -> None:
    x, w, offs = _grouped([4, 0, 9], k=256, n=200)
    wq, ws = fp8.quantize_weight(w, "block")
    xq, xs = fp8.quantize_groups(x)
    with pytest.raises(ValueError, match="mode='block'"):
        fp8.grouped_scaled_linear(*fp8.quantize_rows(x), wq, ws, offs)
    y = fp8.grouped_scaled_linear(xq, xs, wq, ws, offs, "block")
    start = 0
    for i, c in enumerate([4, 0, 9]):  # each expert's rows: the dense block product with its weight
        want = fp8.scaled_linear_reference(xq[start:start + c], xs[start:start + c], wq[i], ws[i], "block")
        assert torch.equal(y[start:start + c], want)
        start += c
    with pytest.raises(ValueError, match=r"\[M, K/128\]"):
        fp8.grouped_scaled_linear(*fp8.quantize_rows(x), wq, ws, offs, "block")
    wr, sr = fp8.block_to_rows(wq, ws)
    assert sr.shape == (3, 200, 1)
    deq_b = fp8.dequantize(wq, ws, "block")
    assert torch.allclose(fp8.dequantize(wr, sr, "row"), deq_b, rtol=E4M3_REL * 1.01, atol=1e-6 * deq_b.abs().max())
    with pytest.raises(ValueError, match="offs"):
        fp8.grouped_scaled_linear(xq, xs, wq, ws, offs[:1], "block")


class _Kernel:
    """A Triton kernel's launch syntax; ``fail``: it raises as a kernel that does not compile."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.launches = fail, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches += 1
            if self.fail:
                raise RuntimeError("PassManager::run failed")
        return launch


def test_a_power_of_two_scale_may_be_the_next_power_and_its_failure_is_its_own(monkeypatch) -> None:
    """The start-up check's bounds with power-of-two group scales: an amax a rounding apart
    across a power of two doubles a scale (allowed there, not elsewhere); a SiLU-mul pass in
    that mode that fails its check leaves that kernel mode, at that width, to the reference."""
    x = torch.randn(4, 256, generator=_gen(9)).bfloat16()
    q, s = fp8.quantize_groups(x, pow2=True)
    assert fp8._differs((q, s), (q, s)) == ""
    assert fp8._differs((q, 2 * s), (q, s)) and fp8._differs((q, 2 * s), (q, s), pow2=True) == ""
    assert fp8._differs((q, 4 * s), (q, s), pow2=True)
    assert fp8._differs(((q.float() * 2).to(q.dtype), s), (q, s), pow2=True)  # the codes
    monkeypatch.setattr(fp8_quant, "LAUNCHES", FirstLaunch("FP8 quantization kernel"))
    monkeypatch.setattr(fp8_quant, "applies", lambda x, k: True)  # (here CUDA only)
    launched = []  # the modes the stand-in kernel was launched with
    chunks = {"quant_chunks": type("K", (), {"__getitem__": lambda self, grid: lambda *a, **kw: launched.append(
        kw["MODE"])})(), "next_pow2": lambda k: k}
    monkeypatch.setattr(fp8_quant, "_K", chunks)
    fp8_quant.fail(True, "silu", "group_pow2", 256, torch.bfloat16)
    gu = torch.randn(4, 512, generator=_gen(10)).bfloat16()
    assert fp8_quant.quantize(gu, "group_pow2", "silu", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is None
    assert fp8_quant.quantize(gu, "group", "silu", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is not None
    assert launched == [fp8_quant.MODES["group"]]  # the other mode, at that width, still launches


def test_first_launch_failure_is_remembered_per_key_and_a_later_one_raises():
    runs = FirstLaunch("a kernel")

    def boom() -> None:
        raise RuntimeError("does not compile")
    assert runs.run(lambda: None, "a") and runs.usable("a")
    assert not runs.run(boom, "b") and not runs.usable("b") and runs.usable("a")  # b: the torch path from now on
    with pytest.raises(RuntimeError, match="does not compile"):  # a launched before: the call's own error
        runs.run(boom, "a")
    runs.fail("c")
    assert not runs.usable("c") and runs.usable("d")


_PERSISTENT = """
import json, torch
from teacher_server.ops import fp8, fp8_grouped
fp8_grouped.applies = lambda x, w: True  # (CUDA only: here Triton's interpreter)
g = torch.Generator().manual_seed(0)
counts = [5, 0, 70, 129, 3]
m, e, k, n = sum(counts), len(counts), 256, 384
offs = torch.tensor(counts).cumsum(0).to(torch.int32)
x = torch.randn(m, k, generator=g).bfloat16()
wq, ws = fp8.quantize_weight(torch.randn(e, n, k, generator=g) / 16, "row")
ws = ws.reshape(e, n)
out = []
for xq, xs, xg in (fp8.quantize_groups(x) + (True,), fp8.quantize_rows(x) + (False,)):
    grid = fp8_grouped.grouped_block_mm(xq, xs, wq, ws, offs, x_groups=xg, w_blocks=False, bm=64)
    ref = fp8.grouped_scaled_linear_reference(xq, xs, wq, ws[..., None], offs, "row", torch.float32)
    for progs in (1, 3, 7):
        got = fp8_grouped.grouped_block_mm(xq, xs, wq, ws, offs, x_groups=xg, w_blocks=False, bm=64, persistent=progs)
        out.append([torch.equal(got, grid), float((got.float() - ref).abs().max() / ref.abs().max())])
print(json.dumps(out))
"""


def test_the_persistent_grouped_kernel_is_the_one_program_per_tile_kernel() -> None:
    """``grouped_block_mm(..., persistent=P)``: P programs walking the tiles (uneven and empty
    experts, more tiles than programs) give the one-program-per-tile kernel's output, 1x128
    input groups and per-row input, in Triton's interpreter; both near the float32 product."""
    res = json.loads(interpreted(_PERSISTENT))
    assert len(res) == 6 and all(same and err < 0.01 for same, err in res), res


def test_a_kernel_that_fails_to_compile_leaves_its_calls_to_the_reference(monkeypatch) -> None:
    """Its first launch failing, the fused op runs its torch reference from then on (one warning,
    no second launch; the one-read SiLU-mul's failure leaves its calls to the two-pass kernel,
    whose failure to the reference); a kernel that has run once and then fails raises."""
    one_read, chunks, rows = _Kernel(fail=True), _Kernel(fail=True), _Kernel(fail=False)
    pow2 = lambda k: 1 << (k - 1).bit_length()  # noqa: E731
    monkeypatch.setattr(fp8_quant, "_K", {"quant_chunks": chunks, "quant_rows": rows, "next_pow2": pow2})
    monkeypatch.setattr(fp8_silu_rows, "_K", {"silu_rows": one_read, "next_pow2": pow2})
    monkeypatch.setattr(fp8_quant, "LAUNCHES", FirstLaunch("FP8 quantization kernel"))
    monkeypatch.setattr(fp8_quant, "applies", lambda x, k: True)
    gu = torch.randn(5, 512, generator=_gen(12)).bfloat16()
    for _ in range(2):
        got = fp8.silu_mul_quant(gu, "row")
        want = fp8.quantize_rows_reference(silu_mul_reference(gu))
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    assert one_read.launches == 1 and chunks.launches == 1
    x = torch.randn(5, 256, generator=_gen(13)).bfloat16()
    assert fp8_quant.quantize(x, "row", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is not None
    rows.fail = True
    with pytest.raises(RuntimeError, match="PassManager"):
        fp8_quant.quantize(x, "row", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR)


def test_kernels_do_not_apply_on_cpu() -> None:
    x = torch.randn(4, 128).bfloat16()
    assert fp8_quant.quantize(x, "row", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is None
    assert not fp8.check_quant_kernels(128, 256, torch.device("cpu"), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_start_up_check_passes_at_model_widths() -> None:
    for hidden, inter in ((5120, 25600), (2048, 768)):
        assert fp8.check_quant_kernels(hidden, inter, torch.device("cuda"), torch.bfloat16)
    assert not fp8.check_quant_kernels(4096, 40960, torch.device("cuda"), torch.bfloat16)  # wider than one program


def test_multiply_check_runs_and_can_fail(monkeypatch) -> None:
    """The start-up check of a multiply passes on the CPU's reference path for every mode, and
    fails on a multiply one e4m3 step off."""
    for mode in fp8.MODES:
        fp8.check_scaled_linear(mode, 256, 64, torch.device("cpu"))
    fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"), experts=6)
    fp8.check_scaled_linear("block", 256, 192, torch.device("cpu"), experts=6)
    fp8.check_scaled_linear("block", 256, 64, torch.device("cpu"), bias=True)
    real = fp8_mm.scaled_linear
    monkeypatch.setattr(fp8_mm, "scaled_linear", lambda *a, **k: real(*a, **k) * 1.07)
    with pytest.raises(RuntimeError, match="differs"):
        fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="differs"):  # fast accumulation's looser bound still fails it
        fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"), fast_accum=True)


@pytest.mark.parametrize("fast", [False, True])
def test_the_experts_check_hands_rows_past_the_last_end_and_ignores_them(monkeypatch, fast: bool) -> None:
    """An expert-parallel rank's rows past ``offs[-1]`` (other ranks' experts) are in the
    experts' check, as the layer hands them; what a kernel leaves there is not compared."""
    real = fp8_mm.grouped_scaled_linear
    ends = []

    def junk(xq, xs, wq, ws, offs, *a, **k):
        y = real(xq, xs, wq, ws, offs, *a, **k)
        ends.append((int(offs[-1]), y.shape[0]))
        y[int(offs[-1]):] = float("nan")
        return y

    monkeypatch.setattr(fp8_mm, "grouped_scaled_linear", junk)
    fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"), experts=6, fast_accum=fast)
    assert ends and all(end < rows for end, rows in ends)


@pytest.mark.parametrize(("off", "fast_passes", "promoted_passes"), [
    (0.0, True, True),
    (0.01, True, False),  # one output 1% of the largest off: a fast-accumulation tail, not a promoted product's
    (0.08, False, False),  # beyond 2^-5 of the largest
    ("2%", False, False),  # every output 2% off: within 2^-5 of the largest, beyond the RMS bound (2^-6)
    ("1%", False, False),  # every output 1% off (a misplaced scale): within the RMS bound, not the slope's
    ("noise", True, False),  # zero-mean noise at the fast sums' 0.0044 relative RMS (an H100 at K = 25,600)
])
def test_the_fast_accumulation_check_allows_its_tails(monkeypatch, off: float | str, fast_passes: bool,
                                                      promoted_passes: bool) -> None:
    """Hopper's fast FP8 accumulation is checked by the product's relative RMS error, its worst
    output against the largest and its slope, not per output against a bf16 step: one output off
    by 1% of the largest, or noise as the fast sums', passes there and fails the promoted
    product's check; a uniform 1% error does not pass."""
    real = fp8_mm.scaled_linear

    def tail(*a, **k):
        assert k.get("fast_accum") == fast  # the check multiplies as it is asked to
        y = real(*a, **k).float()
        if off in ("2%", "1%"):
            return y * (1 + int(off[0]) / 100)
        if off == "noise":
            return y + 0.0044 * y.pow(2).mean().sqrt() * torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
        y[3, 5] += off * y.abs().max()
        return y

    monkeypatch.setattr(fp8_mm, "scaled_linear", tail)
    for fast, want in ((True, fast_passes), (False, promoted_passes)):  # (``tail`` reads ``fast``)
        if want:
            fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"), fast_accum=fast)
        else:
            with pytest.raises(RuntimeError, match="differs"):
                fp8.check_scaled_linear("row", 256, 64, torch.device("cpu"), fast_accum=fast)


# ---------------------------------------------------------------- GPU: kernels and torch's multiplies


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


def _moved(o: torch.Tensor, device: torch.device) -> torch.Tensor:
    """o on device with its strides (``.to`` makes a view into a padded buffer contiguous)."""
    return torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device).copy_(o)


def _ref_on(x: torch.Tensor, fn, *args):
    """A reference computed on the CPU (the kernels never run there) and moved to x's device."""
    out = fn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    return tuple(_moved(o, x.device) for o in out)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype,k", [(torch.bfloat16, 128), (torch.bfloat16, 640), (torch.bfloat16, 5120),
                                     (torch.bfloat16, 25600), (torch.float16, 4096)])
@pytest.mark.parametrize("t", [1, 77, 1000])
def test_quantize_kernels_give_the_references_bits(dtype: torch.dtype, k: int, t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(k + t)
    x = (torch.randn(t, k, device="cuda", generator=g) * 3).to(dtype)
    x[t // 2] = 0  # a zero row
    assert fp8_quant.quantize(x, "row", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is not None  # the kernel ran
    for got, want in ((fp8.quantize_rows(x), _ref_on(x, fp8.quantize_rows_reference, x)),
                      (fp8.quantize_groups(x), _ref_on(x, fp8.quantize_groups_reference, x)),
                      (fp8.quantize_tensor(x), _ref_on(x, fp8.quantize_tensor_reference, x)),
                      (fp8.quantize_tensor(x, torch.tensor([0.004], device="cuda")),
                       _ref_on(x, fp8.quantize_tensor_reference, x, torch.tensor([0.004])))):
        assert got[1].shape == want[1].shape and got[1].stride() == want[1].stride()
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def _one_step(got: tuple, want: tuple, group: int | None) -> None:
    """The fused norm sums in another order: scales within a bf16 step, every value within one
    e4m3 step of the reference's, and at most 1% of the codes different."""
    (q, s), (qr, sr) = got, want
    assert s.shape == sr.shape and s.stride() == sr.stride()
    assert ((s - sr).abs() <= 2 ** -7 * sr).all()
    rep = (lambda v: v.repeat_interleave(group, 1)) if group else (lambda v: v)
    deq, deq_r = q.float() * rep(s), qr.float() * rep(sr)
    assert ((deq - deq_r).abs() <= 2 ** -3 * deq_r.abs() * 1.01 + 2 ** -8 * rep(sr)).all()
    assert (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean() <= 0.01


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["row", "group"])
@pytest.mark.parametrize("k", [640, 5120])
def test_fused_norm_quant_kernel(wdtype: torch.dtype, mode: str, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(333, k, device="cuda", generator=g).bfloat16()
    d = torch.randn(333, k, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(wdtype)
    group = 128 if mode == "group" else None
    assert fp8_quant.quantize(x, mode, "norm", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR, weight=w,
                              eps=1e-6) is not None  # the kernel ran
    got = fp8.rms_norm_quant(x, w, 1e-6, mode)
    _one_step(got, _ref_on(x, fp8.rms_norm_quant, x, w, 1e-6, mode), group)
    s, *got = fp8.add_rms_norm_quant(x, d, w, 1e-6, mode)
    s_ref, *want = _ref_on(x, fp8.add_rms_norm_quant, x, d, w, 1e-6, mode)
    assert torch.equal(s, s_ref)
    _one_step(tuple(got), tuple(want), group)
    static = torch.tensor([0.01], device="cuda")
    _one_step(fp8.rms_norm_quant(x, w, 1e-6, "tensor", static),
              _ref_on(x, fp8.rms_norm_quant, x, w, 1e-6, "tensor", static), None)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("mode", ["row", "group", "group_pow2"])
@pytest.mark.parametrize("inter", [768, 12288, 25600])
def test_fused_silu_mul_quant_kernel(mode: str, inter: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(inter)
    gu = (torch.randn(200, 2 * inter, device="cuda", generator=g) * 4).bfloat16()
    assert fp8_quant.quantize(gu, mode, "silu", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is not None
    _one_step(fp8.silu_mul_quant(gu, mode), _ref_on(gu, fp8.silu_mul_quant, gu, mode),
              128 if mode != "row" else None)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("inter", [768, 12288, 25600])
def test_one_read_silu_mul_row_kernel_at_more_rows_than_programs(inter: int, monkeypatch) -> None:
    """The persistent one-read SiLU-mul (per row): programs walking several rows give the
    reference's codes and scales; the two-pass kernel, switched in, the same."""
    monkeypatch.setattr(fp8_quant, "LAUNCHES", FirstLaunch("FP8 quantization kernel"))  # (whatever a check chose)
    t = fp8_silu_rows.programs(1 << 30, inter, 2, torch.device("cuda")) * 2 + 5
    g = torch.Generator(device="cuda").manual_seed(inter)
    gu = (torch.randn(t, 2 * inter, device="cuda", generator=g) * 4).bfloat16()
    want = _ref_on(gu, fp8.silu_mul_quant, gu, "row")
    _one_step(fp8.silu_mul_quant(gu, "row"), want, None)
    assert ("one_read", "silu", "row", inter, torch.bfloat16) in fp8_quant.LAUNCHES.launched
    monkeypatch.setattr(fp8_silu_rows, "ONE_READ", False)
    _one_step(fp8.silu_mul_quant(gu, "row"), want, None)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """torch's multiply accumulates in float32; its output is rounded once to y's dtype."""
    err = (y.float() - ref.float()).abs()
    step = 2 ** -7 if y.dtype == torch.bfloat16 else 2 ** -20
    assert (err <= step * ref.float().abs() + 1e-3 * ref.float().abs().max()).all(), err.max().item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("mode", fp8.MODES)
@pytest.mark.parametrize("t,k,n", [(1, 128, 128), (77, 640, 336), (1000, 4096, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_linear_gpu(mode: str, t: int, k: int, n: int, out_dtype: torch.dtype) -> None:
    """Each mode against the dequantized float32 product: K = 640 makes ceil(K/128) = 5 (the
    padded scale layout), N = 336 a partial weight block, T = 77 and T = 1 an M not a multiple
    of 4 (cuBLASLt's block recipe refuses it: the rows are padded). The bound is one rounding
    of the float32 sum: a bias is added before it (block mode once rounded twice: 0.031 off at
    ~3 where the bound was 0.031)."""
    x, w, xq, xs, wq, ws = (a.cuda() for a in _operands(t, k, n, mode))
    if mode == "block":
        xs = xs.t().contiguous().t()  # the M-major layout survives the move
    bias = torch.randn(n, device="cuda").bfloat16()
    ref = fp8.scaled_linear_reference(xq, xs, wq, ws, mode, torch.float32, bias)
    y = fp8.scaled_linear(xq, xs, wq, ws, mode, out_dtype, bias=bias)
    assert y.dtype == out_dtype and y.shape == (t, n)
    _close(y, ref)
    if mode == "tensor":  # per-tensor scales on one side, per-row on the other: run as row x row
        wq_r, ws_r = (a.cuda() for a in fp8.quantize_weight(w.cpu(), "row"))
        _close(fp8.scaled_linear(xq, xs, wq_r, ws_r, "row", out_dtype),
               fp8.scaled_linear_reference(xq, xs, wq_r, ws_r, "row", torch.float32))
        xq_r, xs_r = fp8.quantize_rows(x)
        _close(fp8.scaled_linear(xq_r, xs_r, wq, ws, "tensor", out_dtype),
               fp8.scaled_linear_reference(xq_r, xs_r, wq, ws, "tensor", torch.float32))
    if mode == "block":
        _close(fp8.scaled_linear(xq, xs, wq, fp8.pad_block_scale(ws), mode, out_dtype, bias=bias), ref)
        xq_k, xs_k = fp8.quantize_groups(x.cuda())  # the kernel's buffers of round_up(T, 4) rows, read in place
        assert xs_k.stride() == (1, -(-t // 4) * 4)
        _close(fp8.scaled_linear(xq_k, xs_k, wq, ws, mode, out_dtype, bias=bias),
               fp8.scaled_linear_reference(xq_k, xs_k, wq, ws, mode, torch.float32, bias))
        if t > 1 and k > 128:
            with pytest.raises(ValueError, match="M-major"):
                fp8.scaled_linear(xq, xs.contiguous(), wq, ws, mode)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("counts", [[5, 0, 19, 1, 0, 7], [300, 1, 0, 211]])
def test_grouped_scaled_linear_gpu(counts: list[int]) -> None:
    x, w, offs = _grouped(counts, k=256, n=192)
    x, offs = x.cuda(), offs.cuda()
    for mode in ("row", "tensor"):
        wq, ws = (a.cuda() for a in fp8.quantize_weight(w, mode))
        xq, xs = fp8.quantize_rows(x)
        ref = fp8.grouped_scaled_linear_reference(xq, xs, wq, ws, offs, mode, torch.float32)
        for backend in ("auto", "triton", "torch"):  # auto: the Triton kernel with row scales
            y = fp8.grouped_scaled_linear(xq, xs, wq, ws, offs, backend=backend)
            assert y.dtype == torch.bfloat16 and y.shape == (sum(counts), 192)
            _close(y, ref)
    assert fp8_grouped.grouped_block_mm(xq, xs, wq, ws.reshape(len(counts), -1).expand(-1, 192), offs,
                                        row=True) is not None  # the kernel ran


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("counts,k,n", [([5, 0, 19, 1, 0, 7], 384, 200), ([300, 1, 0, 211, 64], 2048, 1536),
                                        ([0, 0, 3], 768, 2048)])
def test_grouped_block_kernel(counts: list[int], k: int, n: int) -> None:
    """The Triton block-scaled experts' multiply against the dequantized float32 product: uneven
    and empty experts, a partial 128-column weight block (N = 200), Qwen3-30B-A3B's widths."""
    x, w, offs = _grouped(counts, k=k, n=n)
    x, offs = x.cuda(), offs.cuda()
    wq, ws = (a.cuda() for a in fp8.quantize_weight(w, "block"))
    xq, xs = fp8.quantize_groups(x)
    assert fp8_grouped.grouped_block_mm(xq, xs, wq, ws, offs) is not None  # the kernel ran
    y = fp8.grouped_scaled_linear(xq, xs, wq, ws, offs, "block")
    assert y.dtype == torch.bfloat16 and y.shape == (sum(counts), n)
    ref = fp8.grouped_scaled_linear_reference(xq, xs, wq, ws, offs, "block", torch.float32)
    _close(y, ref)
    for bm, warps in ((128, 8),):  # the other tile height (the default is 64 rows, 4 warps)
        _close(fp8_grouped.grouped_block_mm(xq, xs, wq, ws, offs, bm=bm, warps=warps), ref)


@pytest.mark.gpu
@hopper
def test_multiply_checks_pass_at_model_widths() -> None:
    """What a Qwen3-8B / Qwen3-30B-A3B layer would check at start-up, every mode."""
    cuda = torch.device("cuda")
    for mode in fp8.MODES:
        for k, n in ((4096, 6144), (12288, 4096)):
            fp8.check_scaled_linear(mode, k, n, cuda)
        fp8.check_scaled_linear(mode, 4096, 6144, cuda, bias=True)  # Qwen2's qkv bias
    for mode in ("row", "block"):
        fp8.check_scaled_linear(mode, 2048, 1536, cuda, experts=6)
        fp8.check_scaled_linear(mode, 768, 2048, cuda, experts=6)
    for k, n in ((2048, 1536), (768, 2048), (2048, 7168)):  # the experts' down product: torch's, fast accumulation
        fp8.check_scaled_linear("row", k, n, cuda, experts=6, fast_accum=True)
    for k, n in ((4096, 6144), (4096, 24576), (12288, 4096), (25600, 5120)):  # linear layers, fast accumulation
        fp8.check_scaled_linear("row", k, n, cuda, fast_accum=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, hopper])])
@pytest.mark.parametrize("act", ["row", "group", "tensor"])
def test_experts_inputs_made_in_fewer_passes_multiply_as_their_own_pass(device: str, act: str) -> None:
    """The FP8 experts' inputs as ``Fp8Weights`` makes them on the device: ``gather_input`` (the
    T rows quantized, then codes and scales gathered: on the GPU the Triton pass's M-major group
    scales come out of the gather row-major) holds the gathered rows' codes and scales, and the
    grouped multiply gives the same bits from either; ``silu_mul_input(.., "down")`` over rows
    whose tail holds NaN (an expert-parallel rank's rows past its end) leaves the rows before
    it as they are alone."""
    from types import SimpleNamespace

    from teacher_server.layers.formats.base import extra_name
    from teacher_server.layers.formats.fp8 import INPUT_SCALE, SCALE, Fp8Weights
    from teacher_server.layers.formats.fp8_config import Fp8Scheme

    dev = torch.device(device)
    counts, t, k, n, end = [5, 0, 19, 1, 0, 7], 13, 256, 192, 20
    g = _gen(3)
    h = torch.randn(t, k, generator=g).bfloat16().to(dev)
    index = torch.randint(0, t, (sum(counts),), generator=g).to(dev)
    w = torch.randn(len(counts), n, k, generator=g) * k ** -0.5
    gu = (4 * torch.randn(sum(counts), 2 * k, generator=g)).bfloat16().to(dev)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
    wmode = "block" if act == "group" else "row"
    fmt = Fp8Weights("fp8", Fp8Scheme("block" if act == "group" else "channel",
                                      activations="static" if act == "tensor" else "dynamic"))
    layer = SimpleNamespace(fp8_mode=wmode, fp8_kernel=True, fp8_down_groups=act != "tensor", fp8_down_pow2=False)
    layer.gate_up, ws = (a.to(dev) for a in fp8.quantize_weight(w, wmode))
    setattr(layer, extra_name("gate_up", SCALE), ws)
    for slot in ("gate_up", "down"):
        setattr(layer, extra_name(slot, INPUT_SCALE), torch.tensor([0.02], device=dev))
    if dev.type == "cuda":  # the Triton pass, not its reference
        assert fp8_quant.quantize(h, "row", fp8_max=fp8.FP8_MAX, amax_floor=fp8.AMAX_FLOOR) is not None
    got = fmt.gather_input(layer, "gate_up", h, index)
    want = h.index_select(0, index)
    wq, wsc = fmt._quantize_input(layer, "gate_up", want)
    assert torch.equal(got.q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(got.scale, wsc)
    y, y_want = (fmt.apply_experts(layer, "gate_up", x, offs, None) for x in (got, want))
    assert torch.equal(y, y_want)
    gu_tail = gu.clone()
    gu_tail[end:] = float("nan")
    tail, alone = fmt.silu_mul_input(layer, gu_tail, "down"), fmt.silu_mul_input(layer, gu[:end].clone(), "down")
    assert torch.equal(tail.q[:end].view(torch.uint8), alone.q.view(torch.uint8))
    assert torch.equal(tail.scale if act == "tensor" else tail.scale[:end], alone.scale)


_SILU_ROWS = """
import json, torch
import triton.language as tl
from teacher_server.ops import fp8_quant, fp8_silu_rows
k = dict(fp8_quant._kernels(), **fp8_silu_rows._kernels())
fp8_quant.libdevice = fp8_silu_rows.libdevice = tl  # (the interpreter has no libdevice: its tl.exp; the kernels' globals resolve here)
g = torch.Generator().manual_seed(3)
out = []
for t, i, progs, chunk in ((11, 384, 4, 128), (3, 200, 5, 64), (9, 256, 1, 256), (8, 256, 4, 128)):
    gu = (4 * torch.randn(t, 2 * i, generator=g)).bfloat16()
    want_q, want_s = torch.empty(t, i, dtype=torch.float8_e4m3fn), torch.empty(t, 1)
    k["quant_chunks"][(t,)](gu, gu.stride(0), want_q, i, want_s, t, t, i, 448.0, 1e-12, SILU=True, MODE=0,
                            CHUNK=chunk, GROUP=128)
    got_q, got_s = torch.zeros(t, i, dtype=torch.float8_e4m3fn), torch.zeros(t, 1)
    scratch = torch.full((min(progs, t), i), float("nan"), dtype=gu.dtype)
    k["silu_rows"][(min(progs, t),)](gu, gu.stride(0), got_q, i, got_s, scratch, t, i, 448.0, 1e-12, CHUNK=chunk)
    out.append([torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), torch.equal(got_s, want_s),
                bool((got_s > 0).all())])
print(json.dumps(out))
"""


def test_the_one_read_silu_mul_row_kernel_gives_the_two_pass_kernels_bits() -> None:
    """``silu_rows`` (persistent: programs walking several rows, a row narrower than a chunk and
    a tail chunk, one program for all rows, programs with equal rows)
    writes ``quant_chunks``' codes and scales, bit for bit, in Triton's interpreter (whose
    roundings both share)."""
    res = json.loads(interpreted(_SILU_ROWS))
    assert res == [[True, True, True]] * 4, res
