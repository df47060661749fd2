"""Engine: the synchronous prefill-only scoring engine (load, admit, step, finish).

Used directly by the in-process Python API and driven by AsyncEngine's thread in the
server. Not thread-safe on its own: one thread calls it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from teacher_server.compile_cache import cache_summary, use_compile_cache
from teacher_server.config import Config
from teacher_server.engine.block_manager import BlockManager
from teacher_server.engine.inflight import InFlightStep, PlannedStep
from teacher_server.engine.process_group import init_group, rank_device
from teacher_server.engine.rank_setup import (
    check_pipeline,
    check_split,
    load_rank,
    make_runner,
    model_spec,
    placement,
    plan_memory,
    resolve_device,
    resolve_dtype,
)
from teacher_server.engine.request import ErrorKind, ScoreRequest, ScoreResult
from teacher_server.engine.scheduler import Scheduler, SchedulerConfig
from teacher_server.engine.sequence import Sequence
from teacher_server.engine.startup_phases import StartupPhases
from teacher_server.engine.state_slots import StateSlots
from teacher_server.engine.stats import EngineStats, StepTiming, StepTrace
from teacher_server.engine.stepping import Stepping
from teacher_server.engine.tp_workers import TPWorkers
from teacher_server.engine.tuning import Tuning
from teacher_server.engine.warm_up import WARM_UP_BATCHES, warm_up_plan
from teacher_server.hub import resolve_model
from teacher_server.ops.fused import SWITCHES

log = logging.getLogger(__name__)


class Engine(Stepping):
    """Load a model, admit requests, run steps (``Stepping``), hand back results. ``stats()``
    reports, ``tuning`` switches optimisations of the built engine."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        t0 = time.perf_counter()
        self.device = resolve_device(cfg.device)
        # before anything compiles or fla-core is imported; the processes started below inherit it
        self.compile_cache = use_compile_cache(cfg.compile_cache_dir) if self.device.type == "cuda" else None
        cache_before = cache_summary(self.compile_cache)
        phases = StartupPhases()
        if cfg.model is None:
            from teacher_server.demo_model import ensure_demo_model

            model_dir = ensure_demo_model(cfg.demo_model_dir)
            log.warning("no model given: serving the built-in demo model at %s; its weights are RANDOM, "
                        "its scores are meaningless", model_dir)
        else:
            model_dir = resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir,
                                      weights=cfg.load_format != "dummy")
        self.model_dir = Path(model_dir)
        phases.done("model files")
        self.spec = model_spec(cfg, self.model_dir)
        self.served_model_name = cfg.served_model_name or (cfg.model if cfg.model else "teacher-server-demo")
        self.max_model_len = cfg.max_model_len or self.spec.max_position_embeddings
        trained = int(self.spec.max_position_embeddings * max(float(self.spec.rope_scaling.get("factor") or 1), 1.0))
        if self.max_model_len > trained:  # (served all the same: a long-context experiment may mean it)
            log.warning("max_model_len=%d is above the %d positions this model was trained for "
                        "(max_position_embeddings x its rope scaling factor): scores of later positions are "
                        "extrapolation", self.max_model_len, trained)
        if cfg.deterministic and self.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.dtype = resolve_dtype(cfg.dtype, self.spec, self.device)
        check_split(self.spec, cfg.tensor_parallel_size, cfg.moe_parallel)
        stages = check_pipeline(self.spec, cfg.pipeline_parallel_size)
        size = cfg.tensor_parallel_size * cfg.pipeline_parallel_size  # ranks: tensor x pipeline parallel
        # Ranks 1..size-1 in worker processes (tp_workers says why); this process is rank 0 (under
        # pipeline parallel a rank of the last stage: the results are made where they are read).
        self._workers: TPWorkers | None = None
        # opened first (a path that cannot be written fails start-up before the load); the
        # steps are traced from the end of the warm-up
        self._trace: StepTrace | None = StepTrace(cfg.step_trace) if cfg.step_trace else None
        self._tracing = False
        placed = []  # (tensor-parallel placement, pipeline stage) of rank 0

        def join() -> None:
            init_group(self.device, 0, size, workers.store)
            placed.append(placement(cfg, self.spec, 0))  # (makes the stages' groups: collective)
        if size > 1:
            self._workers = workers = TPWorkers(cfg, self.model_dir, self.device, size)
            try:
                self._workers.wait_joined()
                self.device = rank_device(self.device, 0)
                workers.form_group(join)
            except BaseException:
                self.close()
                raise
        tp, stage = placed[0] if placed else placement(cfg, self.spec, 0)
        if cfg.pipeline_parallel_size > 1:
            log.info("pipeline parallel: %d stages of %d rank(s), layers [lo, hi) per stage %s", len(stages),
                     cfg.tensor_parallel_size, stages)
        phases.done("workers")
        try:
            self.model, self.attn = load_rank(cfg, self.model_dir, self.spec, self.device, self.dtype, tp, phases,
                                              stage)
            phases.done("attention checks")
            cache = self.model.cache_layout()  # hybrid models: per-sequence linear-attention state too
            plan = plan_memory(cfg, self.spec, cache, self.device, self.max_model_len, tp)
            if self._workers is not None:
                plan = self._workers.agree_memory(plan)
            num_blocks, state_slots, budget = plan
            need = -(-self.max_model_len // cfg.block_size)
            if num_blocks < need:
                raise RuntimeError(f"KV pool of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one "
                                   f"sequence of max_model_len={self.max_model_len}; lower max_model_len or "
                                   f"raise num_kv_blocks / gpu_memory_utilization")
            prefix = cfg.enable_prefix_caching and not cfg.deterministic
            self._blocks = BlockManager(num_blocks, cfg.block_size, prefix)
            sched = SchedulerConfig(budget, cfg.max_num_seqs, cfg.deterministic, cfg.whole_sequence_fill)
            # (+ the zero slot; a hybrid model's steps carry state slots, even where this rank's layers keep none)
            slots = StateSlots(state_slots + 1) if self.spec.linear_layer_ids else None
            self._scheduler = Scheduler(sched, self._blocks, slots)
            phases.done("memory plan")
            self.runner = make_runner(cfg, self.model, self.attn, plan, self.max_model_len, self.device)
            phases.add(self.runner.startup_s)  # attention plans; compiles, kernel checks and autotuning
            phases.done("KV pool")
        except BaseException:
            self.close()  # the tensor-parallel workers stop and the process group is left
            raise
        self._prefix_caching = prefix
        self._pipeline = cfg.pipeline
        # Layers the host may queue ahead of the GPU within a forward (CUDA; see LaunchPacer).
        self._run_ahead: int | None = 6 if self.device.type == "cuda" else None
        self._seqs: dict[int, Sequence] = {}  # by ScoreRequest.uid
        self._inflight: InFlightStep | None = None  # launched, not yet completed (pipelined)
        self._planned: deque[PlannedStep] = deque()  # sent to the other ranks, not launched here
        self._plan_depth = cfg.pipeline_parallel_size  # steps in flight over the pipeline's stages
        self._failed: list[ScoreResult] = []  # results of a step that failed at launch
        self._timing = StepTiming()
        self._steps = 0
        self._tokens = 0  # computed by the steps launched
        if self.device.type == "cuda":  # build / load the CUDA kernel now, not inside a request
            from teacher_server.ops import extension

            extension.available()
            phases.done("kernel library")
        self.num_kv_blocks = num_blocks  # per rank (each holds its share of the KV heads)
        warm = cfg.warm_up if cfg.warm_up is not None else self.device.type == "cuda"
        try:
            self.warm_up_s = self.warm_up() if warm else 0.0
        except BaseException:
            self.close()  # the tensor-parallel workers free their GPUs
            raise
        phases.done("warm-up requests")
        self.startup_phases = phases.seconds
        log.info("start-up took %s; compile cache %s", phases.line(),
                 cache_before if self.compile_cache is None else f"{cache_before} before, "
                 f"{cache_summary(self.compile_cache).split(': ', 1)[1]} after")
        if self._trace is not None:
            self._trace.begin()
            self._tracing = True
        log.info("engine ready: %s (%s) on %s x %d, dtype %s, attention %s, %d KV blocks x %d, budget %d tokens, "
                 "max_model_len %d, loaded in %.1fs", self.spec.architecture, self.model_dir, self.device, size,
                 str(self.dtype).replace("torch.", ""), self.attn.name, num_blocks, cfg.block_size, budget,
                 self.max_model_len, time.perf_counter() - t0)

    def warm_up(self) -> float:
        """Score synthetic requests shaped like serving (``warm_up_plan``), then forget them:
        the prefix cache and snapshots are reset and the counters start from zero. Returns the
        seconds it took."""
        t0 = time.perf_counter()
        plan = warm_up_plan(self.spec.vocab_size, self.max_model_len, self._scheduler.cfg.max_num_batched_tokens,
                            self._blocks.block_size)
        spent = []  # seconds per batch, for the log line: where one-time compiles still happen
        for batch in plan:  # one after another: the shared prompt is cached before its second use
            t = time.perf_counter()
            for r in self.run_to_completion(batch):
                if r.error is not None:
                    raise RuntimeError(f"start-up warm-up failed: {r.error}")
            spent.append(time.perf_counter() - t)
        self.reset_prefix_cache()
        self._blocks.query_tokens = self._blocks.hit_tokens = 0
        self._timing, self._steps, self._tokens = StepTiming(), 0, 0
        dt = time.perf_counter() - t0
        log.info("warm-up: %d synthetic requests in %.1fs (%s)", sum(map(len, plan)), dt,
                 ", ".join(f"{name} {s:.1f}s" for name, s in zip(WARM_UP_BATCHES, spent)))
        return dt

    def watch_workers(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook`` when a tensor-parallel worker dies (from a watchdog thread, at once,
        even while this engine's thread is blocked in a collective); no-op at size 1."""
        if self._workers is not None:
            self._workers.on_failure(hook)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; none at size 1)."""
        return [] if self._workers is None else [p.pid for p in self._workers.procs]

    def kill_workers(self) -> None:
        """Kill the tensor-parallel workers at once (any thread): the engine is dead, or its
        thread is stuck in a step and will not stop them itself. A collective it sits in then
        fails (its peers are gone) instead of waiting out its timeout."""
        workers = self._workers
        if workers is not None and workers.failure is None:  # (after a failure its watchdog killed them)
            workers.kill()

    def close(self) -> None:
        """Stop the tensor-parallel workers (none at size 1). The engine cannot step after."""
        if self._trace is not None:
            self._trace.close()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    # --- requests ----------------------------------------------------------------------
    def add_request(self, req: ScoreRequest) -> ScoreResult | None:
        """Queue a validated request. Returns its result at once if it needs no forward."""
        if req.uid in self._seqs:  # the same ScoreRequest object twice (ids may repeat, uids never)
            raise ValueError(f"request {str(req.request_id)[:100]!r} (uid {req.uid}) is already queued")
        seq = Sequence(req, self._blocks.block_size, self._prefix_caching)
        seq.result = ScoreResult.empty_for(req)
        if seq.num_tokens == 0:
            seq.result.finished_at = time.monotonic()
            return seq.result
        self._scheduler.add(seq)  # (first: a request it cannot order is held nowhere)
        self._seqs[req.uid] = seq
        return None

    def abort_request(self, uid: int, kind: ErrorKind = ErrorKind.CANCELLED,
                      message: str = "request cancelled") -> ScoreResult | None:
        """Drop a request (by ``ScoreRequest.uid``) and free its blocks; its failed result,
        or None when it is not held (already answered)."""
        seq = self._seqs.pop(uid, None)
        if seq is None:
            return None
        self._scheduler.abort(seq)
        seq.result.error, seq.result.error_kind = message, kind
        seq.result.finished_at = time.monotonic()
        return seq.result

    def has_unfinished(self) -> bool:
        return (self._scheduler.has_work() or self._inflight is not None or bool(self._planned)
                or bool(self._failed))

    # --- reporting and switches ----------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and queues."""
        bm, sl = self._blocks, self._scheduler.slots
        return EngineStats(timing=self._timing.copy(), steps=self._steps, computed_tokens=self._tokens,
                           waiting=self._scheduler.num_waiting, running=self._scheduler.num_running,
                           active_requests=len(self._seqs), kv_blocks_used=bm.num_used,
                           kv_blocks_total=bm.num_blocks, prefix_query_tokens=bm.query_tokens,
                           prefix_hit_tokens=bm.hit_tokens, state_slots_total=sl.num_slots - 1 if sl else 0,
                           state_slots_used=sl.num_used if sl else 0, state_snapshots=sl.num_snapshots if sl else 0,
                           token_budget=self._scheduler.cfg.max_num_batched_tokens,
                           kv_tokens_total=bm.num_blocks * bm.block_size,
                           kernels=tuple((n, bool(getattr(self.runner.ops, n))) for n in SWITCHES))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block no request holds (and the state snapshots bound to them)."""
        self._blocks.reset_prefix_cache()

    @property
    def fused_stages_compiled(self) -> bool:
        """Whether the fused elementwise stages run compiled (False: eager; the CPU, or a
        compile that failed its start-up check)."""
        return self.runner.ops.compiled

    @property
    def tuning(self) -> Tuning:
        """The engine's switches now (see ``Tuning``); assign a changed copy to change them."""
        return Tuning(pipeline=self._pipeline, token_budget=self._scheduler.cfg.max_num_batched_tokens,
                      whole_fill=self._scheduler.cfg.whole_fill,
                      prefix_caching=self._prefix_caching, residual_in_gemm=self.runner.ops.residual_in_gemm,
                      last_layer_rows_only=self.runner.model.last_layer_rows_only, run_ahead=self._run_ahead,
                      attention=self.runner.attn)

    @tuning.setter
    def tuning(self, t: Tuning) -> None:
        assert t.token_budget > 0 and 0.0 <= t.whole_fill <= 1.0 and (t.run_ahead is None or t.run_ahead >= 1), t
        if t.prefix_caching and self.cfg.deterministic:
            raise ValueError("deterministic mode runs without the prefix cache")
        if self._workers is not None and t.residual_in_gemm != self.runner.ops.residual_in_gemm:
            raise ValueError("residual_in_gemm is fixed under tensor parallel (every rank must add alike)")
        if self._workers is not None and t.last_layer_rows_only != self.runner.model.last_layer_rows_only:
            raise ValueError("last_layer_rows_only is fixed under tensor parallel (all-reduces of the same rows)")
        if t.run_ahead is None and self.device.type == "cuda":  # its events say when results are on the host
            raise ValueError("launches on CUDA are paced (a run_ahead of the layer count never waits)")
        self._pipeline = t.pipeline
        self._scheduler.cfg.max_num_batched_tokens = t.token_budget
        self._scheduler.cfg.whole_fill = t.whole_fill
        self._prefix_caching = self._blocks.enable_prefix_caching = t.prefix_caching
        self.runner.set_tuning(t.residual_in_gemm, t.last_layer_rows_only)
        self._run_ahead = t.run_ahead
        self.runner.attn = self.attn = t.attention

    def run_to_completion(self, reqs: list[ScoreRequest]) -> list[ScoreResult]:
        """Score a batch synchronously (the in-process API)."""
        results: dict[int, ScoreResult] = {}
        for r in reqs:
            immediate = self.add_request(r)
            if immediate is not None:
                results[r.uid] = immediate
        while self.has_unfinished():
            for res in self.step():
                results[res.uid] = res
        return [results[r.uid] for r in reqs]
