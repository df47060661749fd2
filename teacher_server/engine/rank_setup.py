"""What every tensor-parallel rank builds the same way (the engine's process for rank 0, a
worker process for the others): its shard of the model, its attention backend, its KV pool
size (KV blocks and linear-attention state slots) from its own free memory, and its model
runner."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch

from teacher_server.attention import make_backend
from teacher_server.attention.base import AttentionBackend
from teacher_server.cache_layout import CacheLayout
from teacher_server.config import Config
from teacher_server.engine.model_runner import ModelRunner
from teacher_server.engine.startup_phases import StartupPhases
from teacher_server.layers.parallel import TensorParallel
from teacher_server.layers.pipeline import WHOLE, PipelineStage, make_stage, split_layers, stage_ranks
from teacher_server.models.base import TeacherModel
from teacher_server.models.loader import load_model
from teacher_server.models.spec import ModelSpec
from teacher_server.ops import top_k

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(no_gpu_message())
    return torch.device(name)


def check_gpus(device: str, tensor_parallel_size: int, data_parallel_size: int,
               pipeline_parallel_size: int = 1, nnodes: int = 1) -> None:
    """Before anything starts: RuntimeError saying what to do when ``device`` asks for GPUs
    that are not there (cuda without any, or fewer than the replicas x ranks need; over
    ``nnodes`` hosts, this host's share)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(no_gpu_message())
    if device == "cpu" or not torch.cuda.is_available():
        return
    need = tensor_parallel_size * pipeline_parallel_size * data_parallel_size // nnodes
    have = torch.cuda.device_count()
    if have < need:
        pp = f" x pipeline_parallel_size={pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
        pp += f" / nnodes={nnodes}" if nnodes > 1 else ""
        raise RuntimeError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size}{pp} "
                           f"needs {need} GPUs, {have} visible (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower them or make more visible")


def no_gpu_message() -> str:
    """Why device=cuda cannot start here, and what to do."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else f"torch {torch.__version__}"
    return (f"device=cuda but no CUDA GPU is available ({where}): run on a machine with an NVIDIA GPU and driver "
            f"(in a container: --gpus all / a nvidia.com/gpu limit), or pass --device cpu (or auto)")


def model_spec(cfg: Config, model_dir: Path | str) -> ModelSpec:
    """The model's spec as every rank reads it: the checkpoint's, with the configured
    quantization (``Config.quantization``) and FP8 accumulation (``Config.fp8_fast_accum``)."""
    return ModelSpec.from_dir(model_dir).with_quantization(cfg.quantization, cfg.fp8_fast_accum)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are slow on CPU, and float32 is the exact path
    return torch.float16 if str(spec.torch_dtype).replace("torch.", "") == "float16" else torch.bfloat16


def load_rank(cfg: Config, model_dir: Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
              tp: TensorParallel, phases: StartupPhases | None = None,
              stage: PipelineStage = WHOLE) -> tuple[TeacherModel, AttentionBackend]:
    """This rank's model shard (its pipeline ``stage``'s layers) and attention backend
    (``phases``: the weights' time is marked there; the backend's, its self-checks, is the
    caller's next phase)."""
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, spec, dtype, device, cfg.load_format, cfg.seed, tp, stage)
    if phases is not None:
        phases.done("weights")
    # deterministic: a sequence's attention path must not depend on what ran before; the backend
    # must honour every layer's attention arguments (windows, soft-caps), else another is picked
    needs = model.cache_layout().params()
    return model, make_backend(cfg.attention_backend, device, dtype, deterministic=cfg.deterministic, needs=needs)


def tensor_parallel(cfg: Config, rank: int, group: object = None) -> TensorParallel:
    """Tensor-parallel rank ``rank``'s placement (``group``: its stage's process group under
    pipeline parallel); deterministic mode makes the row-parallel products in one part (a
    part's rows would follow the batch, and the GEMM's kernel with them)."""
    return TensorParallel(cfg.tensor_parallel_size, rank, 1 if cfg.deterministic else cfg.tp_comm_parts,
                          cfg.moe_parallel, group)


def placement(cfg: Config, spec: ModelSpec, rank: int) -> tuple[TensorParallel, PipelineStage]:
    """Global rank ``rank``'s tensor-parallel placement and pipeline stage. Under pipeline
    parallel with tensor parallel each stage's ranks get a process group of their own: every
    rank makes every stage's group, in stage order (``new_group`` is collective)."""
    pp, tp = cfg.pipeline_parallel_size, cfg.tensor_parallel_size
    stage = make_stage(rank, pp, tp, spec.num_layers)
    group = None
    if pp > 1 and tp > 1:
        import torch.distributed as dist

        groups = [dist.new_group(stage_ranks(s, pp, tp)) for s in range(pp)]
        group = groups[stage.stage]
    return tensor_parallel(cfg, rank % tp, group), stage


def check_pipeline(spec: ModelSpec, size: int) -> list[tuple[int, int]]:
    """The stages' layer ranges; ValueError (at start-up) for a split the engine cannot run."""
    return split_layers(spec.num_layers, size)


def check_split(spec: ModelSpec, size: int, moe: str = "tensor") -> None:
    """Refuse a tensor-parallel size the model cannot be split by (ValueError, at start-up);
    ``moe``: how the expert layers are split (``moe_parallel``)."""
    if spec.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {spec.num_heads} attention heads")
    dense = any(not spec.is_moe_layer(i) for i in range(spec.num_layers))
    if dense and spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the MLP's intermediate size "
                         f"{spec.intermediate_size}")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} neither divides the model's {kv} KV heads nor is a "
                         f"multiple of them (KV heads are split, or replicated evenly)")
    if spec.shared_expert_intermediate_size and spec.shared_expert_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the shared expert's intermediate size "
                         f"{spec.shared_expert_intermediate_size}")
    if spec.num_experts and moe == "expert" and spec.num_experts % size:
        raise ValueError(f"moe_parallel=expert: tensor_parallel_size={size} does not divide the model's "
                         f"{spec.num_experts} experts (each rank holds E / size whole experts); use a size that "
                         f"divides them, or moe_parallel=tensor")
    if spec.num_experts and moe != "expert" and spec.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the experts' intermediate size "
                         f"{spec.moe_intermediate_size}")
    if spec.linear_layer_ids and spec.linear_num_key_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {spec.linear_num_key_heads} "
                         f"linear-attention key heads")


# Automatic sizing gives the linear-attention state slots of a hybrid model at most this
# share of the memory for the pool (KV and state); the KV blocks take the rest.
STATE_SHARE = 0.25
# The token budgets automatic sizing on a GPU picks from, largest first: the largest whose step
# activations (``activation_bytes``, a generous estimate: about 6x what Qwen3-8B and -32B steps
# measured) take at most ACT_SHARE of the memory left after the weights and which leaves a KV pool
# of at least max(max_model_len, 4 x budget) tokens; else the last. A larger step spreads each
# step's fixed costs (its launches, its last wave of tiles, the pipeline's hand-over) over more
# tokens: on an H200 32768 ran Qwen3-8B's W1 0.8% and W1f 0.4% faster than 16384, W3 0.2% slower,
# and Qwen3-32B's W4 0.5% faster (bench/results/README.md). The CPU's budget is 2048.
AUTO_BUDGETS = (32768, 16384)
ACT_SHARE = 0.4


class MemoryPlan(NamedTuple):
    """What a rank's memory holds: KV blocks, linear-state slots (zero slot excluded), and the
    token budget of a step whose activations it leaves room for."""

    blocks: int
    slots: int
    budget: int


def activation_bytes(cfg: Config, spec: ModelSpec, budget: int, max_model_len: int, tp: TensorParallel,
                     cache: CacheLayout) -> int:
    """A generous estimate of one step's activations on a rank: per token (this rank's shares of
    the heads and the MLP; the residual stream is whole, float32 bounds), one logits chunk of
    this rank's vocab share, the packed keys and values of a long chunked sequence (its prefix
    gathered per layer, at the widest layer's), an expert layer's k rows per token (its experts'
    full width under expert parallel), DeepSeek's routers' bf16 parts (every layer's: a bound
    under pipeline parallel), and on hybrid models a linear layer's per-chunk (64 tokens)
    and per-sequence float32 states."""
    act = budget * ((spec.q_size + 2 * spec.kv_size + 3 * spec.intermediate_size) // tp.size
                    + 6 * spec.hidden_size) * 4
    act += 3 * cfg.logits_chunk_rows * tp.vocab(spec.vocab_size)[1] * 4
    if spec.num_experts:  # an expert layer's rows, k per token: gathered input, gate/up, SiLU-mul, output
        inter = spec.moe_intermediate_size // (1 if tp.moe == "expert" else tp.size)
        act += budget * spec.num_experts_per_tok * (2 * spec.hidden_size + 3 * inter) * 4
    if spec.routing is not None:  # DeepSeek's float32 routers' bf16 parts (``ops.split_gemm``), made at warm-up
        layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
        act += layers * 3 * spec.num_experts * spec.hidden_size * 2
    widest = cache.widest()
    if widest is not None:
        act += 2 * max_model_len * widest.working_bytes_per_token(2)
    if cache.state is not None:
        act += 2 * (budget // 64 + cfg.max_num_seqs) * math.prod(cache.state.rec_shape) * 4
    return act


def plan_memory(cfg: Config, spec: ModelSpec, cache: CacheLayout, device: torch.device, max_model_len: int,
                tp: TensorParallel) -> MemoryPlan:
    """The KV blocks, linear-state slots and token budget that fit this rank's free memory (its
    KV heads, its activations). The budget: ``max_num_batched_tokens``, or on a GPU the largest
    of ``AUTO_BUDGETS`` the memory takes (see there). The slots (0 without ``state``):
    ``linear_state_slots``, or automatically a working slot and a snapshot for each sequence a
    step may hold (2 * max_num_seqs), cut down to ``STATE_SHARE`` of the pool's memory, at least
    2. The KV blocks: ``num_kv_blocks``, or the rest of the pool; only the attention layers
    the model's ``cache_layout`` declares) have KV."""
    state = cache.state
    bytes_per_token = max(cache.bytes_per_token(), 1)
    slot_bytes = state.slot_bytes() if state is not None else 0

    def slots_of(pool: float) -> int:  # before the floor of 2
        if state is None:
            return 0
        return cfg.linear_state_slots or min(2 * cfg.max_num_seqs, int(STATE_SHARE * pool // slot_bytes))

    if device.type != "cuda":
        budget = cfg.max_num_batched_tokens or 2048
        tokens = 2 * max(max_model_len, 4 * budget)
        # as if the auto KV were the pool's (1 - STATE_SHARE)
        slots = slots_of((cfg.num_kv_blocks * cfg.block_size if cfg.num_kv_blocks else tokens) * bytes_per_token
                         / (1 - STATE_SHARE))
    else:
        free, total = torch.cuda.mem_get_info(device)
        room = free - (1 - cfg.gpu_memory_utilization) * total - (1 << 30)  # for the pool and a step
        budgets = (cfg.max_num_batched_tokens,) if cfg.max_num_batched_tokens else AUTO_BUDGETS
        for budget in budgets:
            act = activation_bytes(cfg, spec, budget, max_model_len, tp, cache)
            slots = slots_of(room - act)
            tokens = int((room - act - max(slots, 2 if state is not None else 0) * slot_bytes) // bytes_per_token)
            need = cfg.num_kv_blocks * cfg.block_size if cfg.num_kv_blocks else max(max_model_len, 4 * budget)
            if act <= ACT_SHARE * room and tokens >= need:
                break
        if not cfg.num_kv_blocks and tokens < max(max_model_len, 4 * budget):
            log.warning("only %d tokens of KV fit in GPU memory (rank %d)", max(tokens, 0), tp.rank)
    if state is not None and slots < 2:
        why = "linear_state_slots is" if cfg.linear_state_slots else "linear-state slots fit the memory share:"
        log.warning("only %d %s (rank %d): using 2, the fewest a chunked sequence runs with", slots, why, tp.rank)
        slots = 2
    return MemoryPlan(cfg.num_kv_blocks or max(tokens // cfg.block_size, 1), slots, budget)


def make_runner(cfg: Config, model: TeacherModel, attn: AttentionBackend, plan: MemoryPlan, max_model_len: int,
                device: torch.device) -> ModelRunner:
    runner = ModelRunner(model, attn, plan.blocks, cfg.block_size, max_model_len, device,
                         cfg.logprobs_mode == "raw_logits", cfg.logits_chunk_rows, cfg.compile, plan.slots, plan.budget)
    if model.logits_layer is not None:  # (a pipeline stage before the last scores nothing)
        top_k.prepare(model.logits_layer.rows, device)  # the teacher's top-K kernel: checked and compiled now
    return runner
