"""Engine: the synchronous prefill-only scoring engine (load, admit, step, finish).

Used directly by the in-process Python API and driven by AsyncEngine's thread in the
server. Not thread-safe on its own: one thread calls it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from teacher_server.config import Config
from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.model_runner import HostStep, ModelRunner, PendingOutput
from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.engine.scheduler import Scheduler, SchedulerConfig
from teacher_server.engine.sequence import Chunk, Sequence
from teacher_server.hub import resolve_model
from teacher_server.model.attention import make_backend
from teacher_server.model.loader import load_model
from teacher_server.model.spec import ModelSpec

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are slow on CPU, and float32 is the exact path
    return torch.float16 if str(spec.torch_dtype).replace("torch.", "") == "float16" else torch.bfloat16


class Engine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        t0 = time.perf_counter()
        self.device = resolve_device(cfg.device)
        if cfg.model is None:
            from teacher_server.demo_model import ensure_demo_model

            model_dir = ensure_demo_model(cfg.demo_model_dir)
            log.warning("no model given: serving the built-in demo model at %s; its weights are RANDOM, "
                        "its scores are meaningless", model_dir)
            self.is_demo = True
        else:
            model_dir = resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir, weights=cfg.load_format != "dummy")
            self.is_demo = False
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.from_dir(self.model_dir)
        self.served_model_name = cfg.served_model_name or (cfg.model if cfg.model else "teacher-server-demo")
        self.max_model_len = cfg.max_model_len or self.spec.max_position_embeddings
        if cfg.deterministic and self.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.dtype = resolve_dtype(cfg.dtype, self.spec, self.device)
        torch.manual_seed(cfg.seed)
        self.model = load_model(self.model_dir, self.spec, self.dtype, self.device, cfg.load_format, cfg.seed)
        self.attn = make_backend(cfg.attention_backend, self.device, self.dtype)
        if cfg.deterministic and hasattr(self.attn, "new_plans_per_step"):
            self.attn.new_plans_per_step = None  # a sequence's attention path must not depend on history
        budget = cfg.max_num_batched_tokens or (16384 if self.device.type == "cuda" else 2048)
        self.max_num_batched_tokens = budget
        num_blocks = cfg.num_kv_blocks or self._auto_num_blocks(budget)
        need = -(-self.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise RuntimeError(f"KV pool of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one "
                               f"sequence of max_model_len={self.max_model_len}; lower max_model_len or "
                               f"raise num_kv_blocks / gpu_memory_utilization")
        prefix = cfg.enable_prefix_caching and not cfg.deterministic
        self.blocks = BlockManager(num_blocks, cfg.block_size, prefix)
        self.scheduler = Scheduler(SchedulerConfig(budget, cfg.max_num_seqs, cfg.deterministic), self.blocks)
        self.runner = ModelRunner(self.model, self.attn, num_blocks, cfg.block_size, self.max_model_len,
                                  self.device, cfg.logprobs_mode == "raw_logits", cfg.logits_chunk_rows,
                                  cfg.compile)
        self.prefix_caching = prefix
        self.seqs: dict[str, Sequence] = {}
        self.last_step_tokens = 0
        self._inflight: _InFlight | None = None  # launched, not yet completed (pipelined)
        self._failed: list[ScoreResult] = []  # results of a step that failed at launch
        # Host time per stage, summed (seconds), and work done: where a step's time goes.
        # On CUDA also the GPU's view (CUDA events): gpu_idle_s, time the GPU had run out of
        # queued work while the host was still launching (inside a step, or between a step and
        # the one launched behind it); gpu_s, the rest of each step's span, first kernel to
        # results on the host.
        self.timing = dict.fromkeys(("schedule_s", "prepare_s", "launch_s", "wait_s", "scatter_s", "steps",
                                     "tokens", "gpu_s", "gpu_idle_s"), 0)
        if self.device.type == "cuda":  # build / load the CUDA kernel now, not inside a request
            from teacher_server.ops.gather_logprob import kernel_available

            kernel_available()
        log.info("engine ready: %s (%s) on %s, dtype %s, attention %s, %d KV blocks x %d, budget %d tokens, "
                 "max_model_len %d, loaded in %.1fs", self.spec.architecture, self.model_dir, self.device,
                 str(self.dtype).replace("torch.", ""), self.attn.name, num_blocks, cfg.block_size, budget,
                 self.max_model_len, time.perf_counter() - t0)

    def _auto_num_blocks(self, budget: int) -> int:
        s = self.spec
        bytes_per_token = 2 * s.num_layers * s.kv_size * torch.finfo(self.dtype).bits // 8
        min_tokens = max(self.max_model_len, 4 * budget)
        if self.device.type != "cuda":
            tokens = 2 * min_tokens
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            # Activations of one step: a generous per-token estimate plus one logits chunk.
            act = budget * (s.q_size + 2 * s.kv_size + 3 * s.intermediate_size + 6 * s.hidden_size) * 4
            act += 3 * self.cfg.logits_chunk_rows * s.vocab_size * 4
            # Packed keys of a long chunked sequence (prefix gathered per layer).
            act += 2 * self.max_model_len * s.kv_size * 2 * 2
            avail = free - (1 - self.cfg.gpu_memory_utilization) * total - act - (1 << 30)
            tokens = int(avail // bytes_per_token)
            if tokens < min_tokens:
                log.warning("only %d tokens of KV fit in GPU memory", max(tokens, 0))
        return max(tokens // self.cfg.block_size, 1)

    # --- requests ----------------------------------------------------------------------
    def add_request(self, req: ScoreRequest) -> ScoreResult | None:
        """Queue a validated request. Returns its result at once if it needs no forward."""
        if req.request_id in self.seqs:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        seq = Sequence(req, self.blocks.block_size, self.prefix_caching)
        seq.result = self._new_result(req)
        if seq.num_tokens == 0:
            seq.result.finished_at = time.monotonic()
            return seq.result
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)
        return None

    def _new_result(self, req: ScoreRequest) -> ScoreResult:
        res = ScoreResult(request_id=req.request_id, prompt_tokens=req.length)
        if req.candidates is not None:
            res.token_id_logprobs = np.full((req.rows, req.k), np.nan, dtype=np.float32)
        if req.prompt_logprobs is not None:
            n = max(req.length - 1, 0)
            res.plp_token_logprob = np.zeros(n, dtype=np.float32)
            res.plp_token_rank = np.zeros(n, dtype=np.int64)
            res.plp_topk_ids = np.zeros((n, req.prompt_logprobs), dtype=np.int64)
            res.plp_topk_logprobs = np.zeros((n, req.prompt_logprobs), dtype=np.float32)
        return res

    def abort_request(self, request_id: str, kind: str = "cancelled", message: str = "request cancelled") -> ScoreResult | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        seq.result.error, seq.result.error_kind = message, kind
        seq.result.finished_at = time.monotonic()
        return seq.result

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self._failed)

    # --- stepping ----------------------------------------------------------------------
    def step(self, deliver: Callable[[list[ScoreResult]], None] | None = None) -> list[ScoreResult]:
        """Complete one forward step; return the results of requests that finished (or failed).

        Pipelined (``pipeline``, the default): the step completed here was launched by the
        previous call, and once it is half done this call schedules, prepares and launches the
        next one, so the host work of step N+1 overlaps the GPU work of step N. (Launching it
        earlier would fill the GPU's launch queue and block inside kernel launches, holding
        the GIL that the server's event loop needs; half a step ahead is ample. Within a
        forward, ``LaunchPacer`` keeps the host a few layers ahead for the same reason.) Step
        N is completed inside that launch, when it first waits for the GPU: N's results are
        ready by then. With ``deliver``, they are handed to it right there; the rest are
        returned. The scheduler's bookkeeping for a step (progress, prefix-cache blocks,
        freed blocks) is done at launch: the GPU runs steps in launch order on one stream, so
        a later step may reuse blocks or cached KV of an earlier one that has not finished."""
        results, self._failed = self._failed, []
        cur = self._inflight if self._inflight is not None else self._launch()
        self._inflight = None
        if cur is not None:
            if self.cfg.pipeline:
                t0 = time.perf_counter()
                cur.pending.wait_half()
                self.timing["wait_s"] += time.perf_counter() - t0
                done: list[list[ScoreResult]] = []
                err: list[BaseException] = []

                def complete_cur() -> None:  # runs inside the next launch (or right after it)
                    res: list[ScoreResult] = []
                    try:  # an error here must not be taken for a failure of the launch around it
                        res = self._complete(cur)
                        if deliver is not None:
                            deliver(res)
                            res = []
                    except BaseException as e:  # noqa: BLE001 - re-raised below, outside the launch
                        err.append(e)
                    done.append(res)

                self._inflight = self._launch(after=cur.pending.done, on_first_wait=complete_cur)
                if not done:  # the launch never waited (CPU, a short forward, nothing to launch)
                    complete_cur()
                if err:
                    raise err[0]
                results += done[0]
            else:
                results += self._complete(cur)
        results += self._failed
        self._failed = []
        return results

    def _launch(self, after: torch.cuda.Event | None = None,
                on_first_wait: Callable[[], None] | None = None) -> _InFlight | None:
        """Schedule, prepare and launch one step (asynchronous on CUDA); ``after``: the end of
        the step still in flight, if any (for the GPU idle time between them);
        ``on_first_wait``: see ``ModelRunner.launch``."""
        tm = self.timing
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t1 = time.perf_counter()
        tm["schedule_s"] += t1 - t0
        if not chunks:
            return None
        self.last_step_tokens = sum(c.end - c.start for c in chunks)
        try:
            hs = self.runner.prepare(chunks)
            t2 = time.perf_counter()
            pending = self.runner.launch(hs, on_first_wait)
        except Exception as e:
            self._fail_step(chunks, e)
            return None
        t3 = time.perf_counter()
        tm["prepare_s"] += t2 - t1
        # waits for the GPU inside the launch count as wait; completing the previous step
        # there counts as its own wait and scatter (``_complete``)
        tm["launch_s"] += t3 - t2 - pending.paced_s - pending.hook_s
        tm["wait_s"] += pending.paced_s
        tm["steps"] += 1
        tm["tokens"] += self.last_step_tokens
        done = self.scheduler.finish_step(chunks)
        return _InFlight(chunks, hs, pending, done, after)

    def _complete(self, cur: _InFlight) -> list[ScoreResult]:
        """Wait for a launched step and copy its results into the requests' arrays."""
        t0 = time.perf_counter()
        try:
            out = self.runner.collect(cur.pending)
            t1 = time.perf_counter()
            self.runner.scatter_results(cur.hs, out)
        except Exception as e:
            self._fail_step(cur.chunks, e)
            return []
        t2 = time.perf_counter()
        self.timing["wait_s"] += t1 - t0
        self.timing["scatter_s"] += t2 - t1
        p = cur.pending
        if p.start is not None and p.done is not None:  # all its events are complete now
            inside = sum(a.elapsed_time(b) for a, b in p.idle_gaps) / 1e3
            self.timing["gpu_s"] += p.start.elapsed_time(p.done) / 1e3 - inside
            self.timing["gpu_idle_s"] += inside
            if cur.after is not None:
                self.timing["gpu_idle_s"] += max(0.0, cur.after.elapsed_time(p.start) / 1e3)
        now = time.monotonic()
        results = []
        for seq in cur.done:
            if seq.result.error is not None:  # aborted while its last step ran: already answered
                continue
            self.seqs.pop(seq.request_id, None)
            seq.result.cached_tokens = seq.num_cached
            seq.result.finished_at = now
            results.append(seq.result)
        return results

    def _fail_step(self, chunks: list[Chunk], e: Exception) -> None:
        """Fail only this step's requests; the engine goes on serving (unless CUDA is gone)."""
        log.exception("forward step failed; failing its %d request(s)", len(chunks))
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        for c in chunks:
            self.scheduler.abort(c.seq)  # also frees blocks of a sequence already finished at launch
            if self.seqs.get(c.seq.request_id) is c.seq:
                r = self.abort_request(c.seq.request_id, "internal", f"inference failed: {type(e).__name__}")
                if r is not None:
                    self._failed.append(r)
        if _is_fatal(e):
            raise e

    def run_to_completion(self, reqs: list[ScoreRequest]) -> list[ScoreResult]:
        """Score a batch synchronously (the in-process API)."""
        results: dict[str, ScoreResult] = {}
        for r in reqs:
            immediate = self.add_request(r)
            if immediate is not None:
                results[r.request_id] = immediate
        while self.has_unfinished():
            for res in self.step():
                results[res.request_id] = res
        return [results[r.request_id] for r in reqs]


@dataclass
class _InFlight:
    chunks: list[Chunk]
    hs: HostStep
    pending: PendingOutput
    done: list[Sequence]  # sequences this step completes (their bookkeeping is done)
    after: torch.cuda.Event | None = None  # end of the step that was in flight at launch


def _is_fatal(e: Exception) -> bool:
    """CUDA errors other than out-of-memory leave the context unusable."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    msg = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in msg or "device-side assert" in msg)
