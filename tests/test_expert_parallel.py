"""Expert parallel (``moe_parallel: expert``): the tensor-parallel ranks hold whole experts,
E / size each. On the CPU (gloo, worker processes) EP=2 gives one process's results within
1e-5 in float32 for Qwen3-MoE (per-expert checkpoint tensors), DeepSeek-V3 (its router, its
ungated shared experts split along their width) and gpt-oss (MXFP4-packed experts, biases:
the down bias once per row; 1e-4 as its TP test says why). Each rank holds exactly its
experts' tensors and reads none of another rank's; the ranks' partial sums of one expert
layer are the whole layer's output for every layout and weight format (stacked and
per-expert tensors, Mixtral's names, a gated shared expert, Qwen3.5-MoE's hybrid layers,
block-FP8 experts through the GPU's dispatch
references), and on the GPU through torch's grouped GEMM; static FP8 input scales are the
largest over every rank's experts (two gloo ranks); an expert count the size does not
divide is refused at start-up, naming the setting; vLLM's ``--enable-expert-parallel``."""

from __future__ import annotations

import multiprocessing as mp
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port
from deepseek_ref import make_deepseek_checkpoint
from fp8util import make_fp8
from oss_ref import make_gpt_oss_checkpoint
from reference import make_hybrid_checkpoint, make_moe_checkpoint
from test_tensor_parallel import assert_same, run

from teacher_server.layers.gpt_oss_moe import GptOssMoe
from teacher_server.layers.moe import SparseMoe
from teacher_server.layers.parallel import TensorParallel
from teacher_server.layers.runtime import Runtime
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec
from teacher_server.ops.fused import FusedOps
from teacher_server.ops.grouped_mm import GroupedGemm

CPU = torch.device("cpu")
PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> a tiny float32 checkpoint (8 experts each), made when first asked."""
    root = tmp_path_factory.mktemp("ep")
    makers = {
        "qwen3moe": lambda p: make_moe_checkpoint("qwen3moe", p),  # per-expert tensors, a dense layer
        "qwen3moe_stacked": lambda p: make_moe_checkpoint("qwen3moe_stacked", p),  # [E, ...] tensors
        "qwen2moe": lambda p: make_moe_checkpoint("qwen2moe:301", p),  # a sigmoid-gated shared expert
        "mixtral": lambda p: make_moe_checkpoint("mixtral", p),  # block_sparse_moe's w1 / w3 / w2
        "qwen3_5_moe": lambda p: make_hybrid_checkpoint("qwen3_5_moe", p),  # linear attention, a shared expert
        "deepseek_v3": lambda p: make_deepseek_checkpoint("v3", p),
        "gpt_oss": lambda p: make_gpt_oss_checkpoint("mxfp4", p),
        "fp8_block": lambda p: make_fp8(make_moe_checkpoint("qwen3moe", p / "src"), p, "block", (16, 16))[0],
        # per-tensor weight scales and a static input scale per expert projection (each its own)
        "fp8_static": lambda p: make_fp8(make_moe_checkpoint("qwen3moe", p / "src"), p, "ct_tensor_static")[0],
    }

    class Lazy(dict):
        def __missing__(self, name: str) -> Path:
            self[name] = makers[name](root / name)
            return self[name]

    return Lazy()


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek_v3", "gpt_oss"])
def test_ep2_equals_one_process(name: str, made: dict[str, Path]) -> None:
    one, hits1 = run(made[name], 1)
    two, hits2 = run(made[name], 2, moe_parallel="expert")
    if name == "gpt_oss":  # large activations on purpose: the ranks' float32 partial sums round apart
        for x, y in zip(one, two, strict=True):
            assert x.error is None and y.error is None, (x.error, y.error)
            fin = np.isfinite(x.token_id_logprobs)
            np.testing.assert_array_equal(np.isfinite(y.token_id_logprobs), fin)
            np.testing.assert_allclose(y.token_id_logprobs[fin], x.token_id_logprobs[fin], rtol=0, atol=1e-4)
    else:
        assert_same(one, two)
    assert hits2 == hits1 > 0


def expert_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The model's first expert layer, bound to eager CPU ops."""
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe | GptOssMoe))
    moe.bind(Runtime(None, FusedOps(kernels=False, compile=False), None, None))  # type: ignore[arg-type]
    return moe


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3moe_stacked", "qwen2moe", "mixtral", "qwen3_5_moe", "deepseek_v3",
                                  "gpt_oss", "fp8_block"])
def test_each_rank_holds_its_experts_and_the_ranks_sum_to_the_layer(name: str, made: dict[str, Path],
                                                                    monkeypatch) -> None:
    """Loaded at EP=2, rank r's expert tensors (weights, biases, the format's) are experts
    [4r, 4r + 4) of the one-process model's, read from the checkpoint as that slice (a
    stacked tensor) or not at all (another rank's per-expert tensor); the shared expert is
    split as at tensor parallel; the ranks' partial outputs of the layer (the all-reduce left
    out) sum to the one-process layer's output."""
    import teacher_server.models.loader as loader

    path = made[name]
    spec = ModelSpec.from_dir(path)
    full = load_model(path, spec, torch.float32, CPU)
    e_local = spec.num_experts // 2
    read: dict[str, tuple[int, ...]] = {}
    real = loader.read_slice

    def spy(sf, hf_name, sl):
        t = real(sf, hf_name, sl)
        read[hf_name] = tuple(t.shape)
        return t

    monkeypatch.setattr(loader, "read_slice", spy)
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)  # the ranks' parts, summed here
    h = torch.randn(37, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    want = expert_layer(full)(h)
    got = torch.zeros_like(want)
    whole = dict(full.named_parameters())
    for r in range(2):
        read.clear()
        shard = load_model(path, spec, torch.float32, CPU, tp=TensorParallel(2, r, moe="expert"))
        ex = expert_layer(shard).experts
        assert (ex.first, ex.num_local, ex.ep.size, ex.tp.size) == (r * e_local, e_local, 2, 1)
        for n, p in shard.named_parameters():
            if ".experts." in n:
                torch.testing.assert_close(p, whole[n][r * e_local:(r + 1) * e_local], rtol=0, atol=0)
        experts = {n: s for n, s in read.items() if ".experts." in n}
        assert experts
        for n, shape in experts.items():
            m = PER_EXPERT.search(n)
            if m is None:  # stacked [E, ...]
                assert shape[0] == e_local, (n, shape)
            elif int(m.group(1)) // e_local != r:  # another rank's expert: nothing read
                assert 0 in shape, (n, shape)
            else:
                assert 0 not in shape, (n, shape)
        got += expert_layer(shard)(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_experts_through_the_gpu_dispatch(made: dict[str, Path], monkeypatch) -> None:
    """Block-FP8 experts multiplied as on a GPU with FP8 products (``ops.fp8``'s references
    here; 16-blocks, so requantized per row): each rank's grouped product over its rows, the
    others' rows past the last row end, gives its part of the one-process layer (activations
    are quantized per row, alike on every rank)."""
    import torch.distributed as dist

    from teacher_server.layers.formats import fp8 as fp8_format

    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    # the attention's split rows take their amax over ranks at load; the experts' rows are whole
    monkeypatch.setattr(dist, "all_reduce", lambda x, *a, **kw: None)
    path, mode = made["fp8_block"], "row"
    spec = ModelSpec.from_dir(path)
    h = torch.randn(29, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    full = expert_layer(load_model(path, spec, torch.float32, CPU))
    assert full.experts.fmt.name == "fp8" and full.experts.fp8_mode == mode
    want = full(h)
    got = 0
    for r in range(2):
        moe = expert_layer(load_model(path, spec, torch.float32, CPU, tp=TensorParallel(2, r, moe="expert")))
        assert moe.experts.fp8_mode == mode and moe.experts.num_local == spec.num_experts // 2
        got = got + moe(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fp8_rank(rank: int, port: int, path: str, queue) -> None:
    """One gloo rank of EP=2 on FP8 experts multiplied as on a GPU (``ops.fp8``'s references):
    its shard loaded (the load's collectives included), the expert layer's all-reduced output
    and its experts' input scales reported by rank 0."""
    import torch.distributed as dist

    from teacher_server.layers.formats import fp8 as fp8_format

    fp8_format.fp8_compute = lambda device: True
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0), rank=rank,
                            world_size=2)
    spec = ModelSpec.from_dir(Path(path))
    moe = expert_layer(load_model(Path(path), spec, torch.float32, CPU, tp=TensorParallel(2, rank, moe="expert")))
    out = moe(torch.randn(29, spec.hidden_size, generator=torch.Generator().manual_seed(2)))
    if rank == 0:
        queue.put((out.numpy(), float(moe.experts.gate_up_input_scale), float(moe.experts.down_input_scale)))
    dist.destroy_process_group()


def test_static_fp8_input_scales_are_the_largest_over_every_ranks_experts(made: dict[str, Path],
                                                                          monkeypatch) -> None:
    """A static FP8 scheme quantizes an expert layer's input with one scale, the largest of its
    experts' input_scale: at EP=2 (two gloo ranks) the maximum over both ranks' experts, as one
    process takes it, so the layer's output is one process's."""
    from teacher_server.layers.formats import fp8 as fp8_format

    monkeypatch.setattr(fp8_format, "fp8_compute", lambda device: True)
    path = made["fp8_static"]
    spec = ModelSpec.from_dir(path)
    full = expert_layer(load_model(path, spec, torch.float32, CPU))
    want = full(torch.randn(29, spec.hidden_size, generator=torch.Generator().manual_seed(2)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fp8_rank, args=(r, port, str(path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    out, gate_up_scale, down_scale = queue.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert (gate_up_scale, down_scale) == (float(full.experts.gate_up_input_scale),
                                           float(full.experts.down_input_scale))
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def rank_part(name: str, whole: torch.Tensor, shape: torch.Size, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part (of ``shape``) of a whole expert layer's parameter ``name``: an
    expert tensor's experts, the shared expert's slice of its width as at tensor parallel
    (gate and up rows, down columns), else all of it (replicated)."""
    if name.startswith("experts."):
        return whole[shape[0] * rank:shape[0] * (rank + 1)]
    if name.startswith("shared_expert.gate_up_proj."):
        n = shape[0] // 2
        g, u = whole.chunk(2)
        return torch.cat([g[n * rank:n * (rank + 1)], u[n * rank:n * (rank + 1)]])
    if name.startswith("shared_expert.down_proj."):
        return whole[:, shape[1] * rank:shape[1] * (rank + 1)]
    return whole


def bound_expert_layer(kind: str, hidden: int, inter: int, gemm: GroupedGemm, ops: FusedOps, dtype: torch.dtype,
                       device: torch.device, tp: TensorParallel) -> torch.nn.Module:
    """A bound expert layer (8 experts, top-2) of ``kind``: "sparse" (SiLU-mul) or "gpt_oss"
    (biases, clamped SwiGLU), split as ``tp`` says."""
    if kind == "sparse":
        moe = SparseMoe(hidden, 8, 2, inter, True, 0, gemm, dtype, device, tp)
    else:
        moe = GptOssMoe(hidden, 8, 2, inter, 1.702, 7.0, gemm, dtype, device, tp)
    moe.bind(Runtime(None, ops, None, None))  # type: ignore[arg-type]
    return moe


def split_layer(layer: Callable[[TensorParallel], torch.nn.Module],
                size: int) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """A random expert layer (``layer(TensorParallel())``, weights drawn from N(0, 0.3) after
    seed 0) and its ``size`` expert-parallel ranks' layers holding their parts of it."""
    torch.manual_seed(0)
    full = layer(TensorParallel())
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
    ranks = [layer(TensorParallel(size, r, moe="expert")) for r in range(size)]
    with torch.no_grad():
        for r, moe in enumerate(ranks):
            for name, p in moe.named_parameters():
                p.copy_(rank_part(name, full.get_parameter(name), p.shape, r))
    return full, ranks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_grouped_rows_of_each_rank_sum_to_the_layer(device: str, padded: bool, tokens: int, monkeypatch) -> None:
    """A random expert layer (16 experts, top-4, a shared expert) cut into 4 ranks' whole
    experts: their outputs sum to the layer's, through torch's grouped GEMM and the padded
    fallback (rows past the last row end: another rank's, never read), with few tokens (ranks
    with no rows) and many; bf16 on the GPU (torch's grouped GEMM), float32 on the CPU."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    ops = FusedOps(kernels=dev.type == "cuda", compile=False)
    gemm = GroupedGemm(allow_torch=not padded)

    def layer(tp: TensorParallel) -> SparseMoe:
        moe = SparseMoe(64, 16, 4, 48, True, 32, gemm, dtype, dev, tp)
        moe.bind(Runtime(None, ops, None, None))  # type: ignore[arg-type]
        return moe

    full, ranks = split_layer(layer, 4)
    if dev.type == "cuda" and not padded and torch.cuda.get_device_capability()[0] == 9:
        # torch's grouped GEMM passes its start-up check (rows past the last row end included)
        assert gemm.use_torch(dev, dtype, ((64, 2 * 48), (48, 64)))
    h = torch.randn(tokens, 64, device=dev).to(dtype)
    want = full(h).float()
    got = sum(moe(h).float() for moe in ranks)
    if dtype == torch.bfloat16:  # each rank's part rounded to bf16, the whole layer's once
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(sum(moe.reference(h) for moe in ranks), want, rtol=1e-5, atol=1e-5)


def test_an_expert_count_the_size_does_not_divide_is_refused_at_start_up(made: dict[str, Path]) -> None:
    """At start-up, before any worker: the expert count for moe_parallel=expert (the experts'
    width then need not divide), the width for tensor."""
    from dataclasses import replace

    from teacher_server.engine.rank_setup import check_split
    from teacher_server.layers.moe import ExpertWeights

    spec = ModelSpec.from_dir(made["qwen3moe"])  # 8 experts of width 32, 4 heads
    check_split(spec, 4, "expert")
    check_split(replace(spec, moe_intermediate_size=30), 4, "expert")
    with pytest.raises(ValueError, match="experts' intermediate size 30"):
        check_split(replace(spec, moe_intermediate_size=30), 4, "tensor")
    with pytest.raises(ValueError, match=r"moe_parallel=expert: tensor_parallel_size=4 does not divide the model's "
                                         r"10 experts"):
        check_split(replace(spec, num_experts=10), 4, "expert")
    check_split(replace(spec, num_experts=10), 4, "tensor")
    with pytest.raises(ValueError, match="experts = 10 does not split over 4 ranks"):
        ExpertWeights(10, 16, 32, torch.float32, CPU, TensorParallel(4, 0, moe="expert"))


def test_enable_expert_parallel_is_vllms_flag_for_it() -> None:
    from teacher_server.cli import config_from_args

    assert config_from_args(["serve", "-tp", "2"]).moe_parallel == "tensor"
    assert config_from_args(["serve", "-tp", "2", "--enable-expert-parallel"]).moe_parallel == "expert"
    assert config_from_args(["serve", "-tp", "2", "-ep"]).moe_parallel == "expert"
    assert config_from_args(["serve", "--moe-parallel", "expert"]).moe_parallel == "expert"
    assert config_from_args(["serve", "-ep", "--moe-parallel", "tensor"]).moe_parallel == "tensor"  # ours wins


class _PoisonedGemm(GroupedGemm):
    """The grouped GEMM with the rows past the last row end filled with NaN: torch's and the
    Triton kernels leave those rows of their ``empty`` output unwritten on the GPU (any bits),
    where the CPU's reference writes zeros."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = super().__call__(a, b, offs)
        out[int(offs[-1]) if offs.numel() else 0:] = float("nan")
        return out


@pytest.mark.parametrize("kind", ["sparse", "gpt_oss"])
def test_rows_of_other_ranks_experts_never_reach_the_output(kind: str, monkeypatch) -> None:
    """Each rank's rows of another rank's experts (sorted past its last row end) hold whatever
    the grouped GEMM left there: NaN here. Neither the activation, the down bias (gpt-oss) nor
    the combine lets them into the rank's partial sum: the ranks still sum to the layer. The
    activation (SiLU-mul, gpt-oss's clamped SwiGLU) reads only the rank's own rows: as many
    as its experts were routed, none of them NaN."""
    from teacher_server.ops import silu_mul as silu_mul_module
    from teacher_server.ops.clamped_swiglu import clamped_swiglu

    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    ops = FusedOps(kernels=False, compile=False)
    gemm = _PoisonedGemm(allow_torch=False)
    seen: list[torch.Tensor] = []  # the activation's input, call by call
    real_silu = silu_mul_module.silu_mul_reference
    monkeypatch.setattr(silu_mul_module, "silu_mul_reference", lambda gu: seen.append(gu) or real_silu(gu))
    ops.clamped_swiglu = lambda gu, *args: seen.append(gu) or clamped_swiglu(gu, *args)

    full, ranks = split_layer(lambda tp: bound_expert_layer(kind, 32, 24, gemm, ops, torch.float32, CPU, tp), 2)
    h = torch.randn(7, 32)
    want = full(h)
    assert torch.isfinite(want).all()
    assert [x.shape[0] for x in seen] == [7 * 2]  # one process: every row its own
    got = 0
    for moe in ranks:
        seen.clear()
        got = got + moe(h)
        ids = moe.route(h)[1]
        mine = int(((ids >= moe.experts.first) & (ids < moe.experts.first + 4)).sum())
        assert [x.shape[0] for x in seen] == [mine] and torch.isfinite(seen[0]).all(), (mine, seen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sparse", "gpt_oss"])
def test_the_row_end_kernels_skip_other_ranks_rows_in_the_layer(kind: str, monkeypatch) -> None:
    """On the GPU, in bf16 with the CUDA kernels on, each expert-parallel rank's activation is
    the row-end kernel (SiLU-mul, gpt-oss's clamped SwiGLU) reading the end on the device: the
    rows past it (NaN from the grouped GEMM here) neither reach the output nor stop the ranks
    summing to the whole layer; the kernels pass their start-up checks at the layer's width."""
    from teacher_server.ops import fused

    dev = torch.device("cuda")
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    ops = FusedOps(kernels=True, compile=False)
    gemm = _PoisonedGemm(allow_torch=False)
    ran: list[bool] = []  # per clamped SwiGLU call with an end: whether the kernel took it
    real = fused.clamped_swiglu_kernel
    monkeypatch.setattr(fused, "clamped_swiglu_kernel", lambda *a: ran.append(real(*a) is not None) or real(*a))

    full, ranks = split_layer(lambda tp: bound_expert_layer(kind, 64, 48, gemm, ops, torch.bfloat16, dev, tp), 2)
    ops.check_silu(48, dev, torch.bfloat16)
    if kind == "gpt_oss":
        ops.check_swiglu(ranks[0].experts.gate_up_bias, 1.702, 7.0)
    assert ops.silu_kernel and ops.swiglu_kernel  # (a failed check logs "... kernel disabled")
    h = torch.randn(37, 64, device=dev).to(torch.bfloat16)
    want = full(h).float()
    got = sum(moe(h).float() for moe in ranks)
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()), (got - want).abs().max()
    assert ran == ([True, True] if kind == "gpt_oss" else [])  # the whole layer has no end; each rank one
