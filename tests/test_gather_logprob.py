"""gather_logprobs: the torch reference and the CUDA kernel against a float64 computation.

CPU tests cover the reference and the wrapper's validation; tests marked ``gpu`` check
the kernel (fresh random inputs, poisoned outputs) and skip when CUDA is absent.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from teacher_server.ops import extension
from teacher_server.ops import gather_logprob as glp
from teacher_server.ops.gather_logprob import gather_logprobs, gather_logprobs_reference

kernel_available = extension.available

REPO = Path(__file__).resolve().parent.parent
# float32 outputs: ~1e-7 relative rounding plus the float32 sum of exps (~1e-7).
RTOL, ATOL = 2e-6, 2e-6
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ref64(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """The same quantity in float64: [R, K] float64, -inf at negative ids."""
    x = logits.double()  # [R, V]
    if cand.dim() == 1:
        cand = cand.unsqueeze(0).expand(x.shape[0], -1)
    idx = cand.long()
    vals = x.gather(1, idx.clamp(min=0))  # [R, K]
    if not logits_mode:
        vals = vals - torch.logsumexp(x, dim=-1, keepdim=True)
    return vals.masked_fill(idx < 0, float("-inf"))


def make_logits(rows: int, vocab: int, *, scale: float = 4.0, offset: float = 0.0, dtype=torch.float32,
                device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=device) * scale + offset
    return x.to(dtype)


def make_cand(rows: int, vocab: int, k: int, *, per_row: bool, dtype=torch.int64, pad_frac: float = 0.1,
              device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """Random ids in [0, vocab) with about pad_frac of them -1 (at least one when k > 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (rows, k) if per_row else (k,)
    c = torch.randint(0, vocab, shape, generator=g, device=device)
    pad = torch.rand(shape, generator=g, device=device) < pad_frac
    if k > 1:
        pad[..., -1] = True
    return c.masked_fill(pad, -1).to(dtype)


def assert_matches(got: torch.Tensor, want64: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want64, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("logits_mode", [False, True])
@pytest.mark.parametrize("cand_dtype", [torch.int32, torch.int64])
def test_reference_matches_float64(per_row: bool, logits_mode: bool, cand_dtype: torch.dtype) -> None:
    logits = make_logits(13, 1031)
    cand = make_cand(13, 1031, 37, per_row=per_row, dtype=cand_dtype)
    got = gather_logprobs_reference(logits, cand, logits_mode)
    assert got.shape == (13, 37)
    assert_matches(got, ref64(logits, cand, logits_mode))
    assert torch.isneginf(got[:, -1]).all()  # -1 padding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_half_logits(dtype: torch.dtype) -> None:
    logits = make_logits(9, 517, dtype=dtype)
    cand = make_cand(9, 517, 16, per_row=True)
    assert_matches(gather_logprobs_reference(logits, cand), ref64(logits, cand))


@pytest.mark.parametrize(("scale", "offset"), [(1.0, 1e4), (1e4, 0.0), (1.0, -1e4)])
def test_reference_large_magnitudes(scale: float, offset: float) -> None:
    # Near 1e4, x - (max + log s) would round at ulp(1e4) ~ 1e-3; the reference must not.
    logits = make_logits(4, 4099, scale=scale, offset=offset)
    cand = make_cand(4, 4099, 64, per_row=True)
    cand[:, 0] = logits.argmax(-1)  # the top candidate: a log-prob near 0
    assert_matches(gather_logprobs_reference(logits, cand), ref64(logits, cand))


def test_wrapper_on_cpu_is_reference_and_fills_out() -> None:
    logits = make_logits(5, 100)
    cand = make_cand(5, 100, 8, per_row=False)
    out = torch.full((5, 8), float("nan"))
    got = gather_logprobs(logits, cand, out=out)
    assert got is out
    torch.testing.assert_close(out, gather_logprobs_reference(logits, cand), rtol=0, atol=0)
    assert gather_logprobs(logits, cand).shape == (5, 8)


def test_wrapper_empty_shapes() -> None:
    assert gather_logprobs(make_logits(0, 10), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
    assert gather_logprobs(make_logits(4, 10), torch.zeros(4, 0, dtype=torch.long)).shape == (4, 0)


def test_wrapper_row_stride() -> None:
    wide = make_logits(6, 300)
    logits = wide[:, 7:257]  # [6, 250], row stride 300
    cand = make_cand(6, 250, 10, per_row=True)
    assert_matches(gather_logprobs(logits, cand), ref64(logits, cand))


@pytest.mark.parametrize(
    ("logits", "cand", "out", "match"),
    [
        (torch.zeros(3), torch.zeros(2, dtype=torch.long), None, "2-D"),
        (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), None, "dtype"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), None, "empty vocab"),
        (torch.zeros(5, 2).t(), torch.zeros(2, dtype=torch.long), None, "contiguous"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.float32), None, "int32 or int64"),
        (torch.zeros(2, 5), torch.zeros(2, 1, 1, dtype=torch.long), None, r"\[K\] or \[rows, K\]"),
        (torch.zeros(2, 5), torch.zeros(3, 4, dtype=torch.long), None, "3 rows"),
        (torch.zeros(2, 5), torch.zeros(4, dtype=torch.long), torch.zeros(2, 3), r"\[2, 4\] float32"),
        (torch.zeros(2, 5), torch.zeros(4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.float64), "float32"),
        (torch.zeros(2, 5), torch.zeros(4, dtype=torch.long), torch.zeros(4, 2).t(), "contiguous"),
    ],
)
def test_wrapper_validation(logits: torch.Tensor, cand: torch.Tensor, out: torch.Tensor | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gather_logprobs(logits, cand, out=out)


def test_kernel_sources_layout() -> None:
    # kernels/ must hold no Python (a top-level `kernels` package shadows a PyPI one).
    kdir = REPO / "kernels"
    assert (kdir / "gather_logprob.cu").is_file()
    assert not list(kdir.glob("*.py"))
    src = extension.source_dir()
    assert all((src / s).is_file() for s in extension.SOURCES)
    assert src.resolve() == kdir.resolve()


def test_installed_package_ships_every_kernel_source() -> None:
    """The wheel carries kernels/ as teacher_server/csrc (package data): its globs must
    cover every source the extension builds from."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["teacher_server"]
    for name in extension.SOURCES:
        assert any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs), (name, globs)
    assert (REPO / "teacher_server" / "csrc" / extension.SOURCES[0]).is_file()  # the link to kernels/


def test_fallback_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(verbose: bool) -> None:
        raise RuntimeError("nvcc exploded\n" + "noise " * 500)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lib = extension.KernelLibrary(builder=broken)
    with caplog.at_level(logging.WARNING, logger=extension.__name__):
        assert lib.load() is None
        assert lib.load() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "nvcc exploded" in warnings[0].getMessage() and len(warnings[0].getMessage()) < 500
    assert "nvcc exploded" in lib.error


# ---------------------------------------------------------------- CUDA kernel


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the reference raise, so a passing GPU test proves the kernel ran."""
    assert kernel_available(), f"CUDA kernel failed to build/load: {extension.library.error}"

    def no_reference(*args, **kwargs):
        raise AssertionError("the torch reference ran on CUDA instead of the kernel")

    monkeypatch.setattr(glp, "gather_logprobs_reference", no_reference)


def run_kernel(logits: torch.Tensor, cand: torch.Tensor, logits_mode: bool = False) -> torch.Tensor:
    """Kernel output written into a NaN-poisoned buffer (catches unwritten elements)."""
    out = torch.full((logits.shape[0], cand.shape[-1]), float("nan"), device=logits.device)
    got = gather_logprobs(logits, cand, logits_mode, out=out)
    assert got is out
    return out


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("vocab", [1, 7, 32000, 151936, 262144])
@pytest.mark.parametrize("k", [1, 64, 256])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("cand_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64(vocab: int, k: int, per_row: bool, cand_dtype: torch.dtype, dtype: torch.dtype) -> None:
    # Many rows for tiny vocabs (several rows per block, a partial last block).
    rows = 1000 if vocab < 4096 else 37
    seed = vocab * 7 + k
    logits = make_logits(rows, vocab, dtype=dtype, device="cuda", seed=seed)
    cand = make_cand(rows, vocab, k, per_row=per_row, dtype=cand_dtype, device="cuda", seed=seed + 1)
    got = run_kernel(logits, cand)
    assert_matches(got, ref64(logits, cand))
    assert_matches(run_kernel(logits, cand, logits_mode=True), ref64(logits, cand, logits_mode=True))


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 1000, 32003, 151936])
@pytest.mark.parametrize("start", [0, 1, 3])
def test_kernel_row_stride_and_misalignment(dtype: torch.dtype, vocab: int, start: int) -> None:
    # Rows start at every alignment: the scalar head/tail paths and the vector body.
    wide = make_logits(21, vocab + 13, dtype=dtype, device="cuda", seed=vocab + start)
    logits = wide[:, start : start + vocab]  # row stride vocab + 13
    assert logits.stride() == (vocab + 13, 1)
    cand = make_cand(21, vocab, 64, per_row=True, device="cuda", seed=start)
    assert_matches(run_kernel(logits, cand), ref64(logits, cand))


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize(("scale", "offset"), [(1.0, 1e4), (1.0, -1e4), (1e4, 0.0), (30.0, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_large_magnitudes(scale: float, offset: float, dtype: torch.dtype) -> None:
    logits = make_logits(16, 151936, scale=scale, offset=offset, dtype=dtype, device="cuda", seed=5)
    cand = make_cand(16, 151936, 256, per_row=True, device="cuda", seed=6)
    cand[:, 0] = logits.float().argmax(-1)  # log-prob near 0: exposes x - (m + log s) rounding
    assert_matches(run_kernel(logits, cand), ref64(logits, cand))


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
def test_kernel_k1024_and_edge_ids() -> None:
    vocab = 50000
    logits = make_logits(8, vocab, device="cuda", seed=11)
    cand = make_cand(8, vocab, 1024, per_row=True, device="cuda", seed=12)
    cand[:, 1] = 0
    cand[:, 2] = vocab - 1
    cand[:, 3] = -7  # any negative id pads
    got = run_kernel(logits, cand)
    assert_matches(got, ref64(logits, cand))
    # An out-of-range id is never read: NaN there, the rest intact.
    cand[:, 4] = vocab
    got = run_kernel(logits, cand)
    assert torch.isnan(got[:, 4]).all()
    keep = torch.ones(1024, dtype=torch.bool)
    keep[4] = False
    assert_matches(got[:, keep], ref64(logits, cand[:, keep]))


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
def test_kernel_infinite_logits() -> None:
    # Masked vocab entries (-inf) are fine; rows with finite values stay exact.
    logits = make_logits(4, 4099, device="cuda", seed=13)
    logits[:, ::3] = float("-inf")
    cand = make_cand(4, 4099, 64, per_row=True, device="cuda", seed=14)
    want = ref64(logits, cand)
    got = run_kernel(logits, cand)
    finite = torch.isfinite(want)
    assert_matches(got[finite], want[finite])
    assert torch.isneginf(got[~finite]).all()


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("vocab", [100, 151936])
def test_kernel_batch_invariant(vocab: int) -> None:
    # Each row's bits do not depend on the other rows (the deterministic mode relies on it).
    logits = make_logits(64, vocab, device="cuda", seed=15)
    cand = make_cand(64, vocab, 64, per_row=True, device="cuda", seed=16)
    full = run_kernel(logits, cand)
    for r in (0, 17, 63):
        one = run_kernel(logits[r : r + 1], cand[r : r + 1])
        assert torch.equal(one, full[r : r + 1])


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
def test_kernel_side_stream_and_default_out() -> None:
    logits = make_logits(32, 32000, device="cuda", seed=17)
    cand = make_cand(32, 32000, 64, per_row=False, dtype=torch.int32, device="cuda", seed=18)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = gather_logprobs(logits, cand)
    stream.synchronize()
    assert got.shape == (32, 64) and got.is_contiguous()
    assert_matches(got, ref64(logits, cand))


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
def test_kernel_rejects_mixed_devices() -> None:
    logits = make_logits(2, 10, device="cuda")
    with pytest.raises(ValueError, match="candidates on cpu"):
        gather_logprobs(logits, torch.zeros(3, dtype=torch.long))


# --- partial mode (vocab-parallel scoring) ---------------------------------------------------

def shard_partials(logits: torch.Tensor, cand: torch.Tensor, ranks: int, logits_mode: bool,
                   fn=glp.gather_logprobs_partial_reference) -> torch.Tensor:
    """Split the vocab into ``ranks`` uneven shards, take each shard's partials with ``fn``
    and merge them: [R, K]."""
    vocab = logits.shape[1]
    bounds = torch.linspace(0, vocab, ranks + 1).round().long().tolist()
    ms, ss, vs = [], [], []
    for a, b in zip(bounds, bounds[1:]):
        m, s, v = fn(logits[:, a:b], cand, a, logits_mode)
        ms.append(m), ss.append(s), vs.append(v)
    return glp.merge_partials(torch.stack(ms), torch.stack(ss), torch.stack(vs), cand, logits_mode)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("logits_mode", [False, True])
def test_partial_reference_merges_to_the_full_one(ranks: int, per_row: bool, logits_mode: bool) -> None:
    """Shards of a vocab not divisible by the rank count, merged, give the full result
    (padding -inf, candidates on every shard, both edges of each shard)."""
    vocab = 1001
    logits = make_logits(9, vocab, seed=ranks)
    cand = make_cand(9, vocab, 16, per_row=per_row, seed=ranks + 1)
    cand[..., 0], cand[..., 1] = 0, vocab - 1
    got = shard_partials(logits, cand, ranks, logits_mode)
    assert_matches(got, ref64(logits, cand, logits_mode))
    torch.testing.assert_close(got, gather_logprobs_reference(logits, cand, logits_mode), rtol=1e-6, atol=1e-6)


def test_partial_reference_shard_outputs() -> None:
    """A shard's candidate logits are 0 outside it (and at padding); m, s are its own."""
    logits = make_logits(3, 10, seed=4)
    cand = torch.tensor([[2, 5, 7, -1], [9, 4, 5, 6], [0, 1, 5, 9]])
    m, s, v = glp.gather_logprobs_partial_reference(logits[:, 5:], cand, 5)
    torch.testing.assert_close(m, logits[:, 5:].amax(-1))
    torch.testing.assert_close(s, torch.exp(logits[:, 5:] - m[:, None]).sum(-1))
    inside = (cand >= 5)
    torch.testing.assert_close(v[inside], logits.gather(1, cand.clamp(min=0))[inside])
    assert (v[~inside] == 0).all()


@pytest.mark.gpu
@cuda_only
@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("vocab", [7, 4096, 32003, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("logits_mode", [False, True])
def test_kernel_partial_matches_reference(vocab: int, dtype: torch.dtype, per_row: bool, logits_mode: bool) -> None:
    """The kernel's partial mode on one shard (small-V warp and block kernels, a misaligned
    shard start) equals the torch reference, and merged over 2 shards the full result."""
    assert hasattr(extension.load(), "gather_logprobs_partial_out"), "the partial kernel is not built"
    rows, k = 37, 64
    logits = make_logits(rows, vocab, dtype=dtype, device="cuda", seed=vocab)
    cand = make_cand(rows, vocab, k, per_row=per_row, device="cuda", seed=vocab + 1)
    start = vocab // 2 + 1  # an odd offset: the shard's rows are not 16-byte aligned
    shard = logits[:, start:]
    m, s, v = glp.gather_logprobs_partial(shard, cand, start, logits_mode)
    rm, rs, rv = glp.gather_logprobs_partial_reference(shard, cand, start, logits_mode)
    torch.testing.assert_close(v, rv, rtol=0, atol=0)  # the logits themselves, widened exactly
    torch.testing.assert_close(m, rm, rtol=0, atol=0)
    torch.testing.assert_close(s, rs, rtol=RTOL, atol=ATOL)
    got = shard_partials(logits, cand, 2, logits_mode, fn=glp.gather_logprobs_partial)
    assert_matches(got, ref64(logits, cand, logits_mode))
