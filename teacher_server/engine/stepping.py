"""The engine's step loop: schedule, prepare and launch a step, complete the one before it
(pipelined: half a step ahead), and fail only a failed step's requests. ``Engine`` runs it
(``step``, ``launch``, ``complete``); the state it works on is the engine's, set up there."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from teacher_server.engine.fatal import is_fatal
from teacher_server.engine.inflight import Handoff, InFlightStep, PlannedStep
from teacher_server.engine.model_runner import ModelRunner
from teacher_server.engine.pacer import LaunchPacer, Pacer, Unpaced
from teacher_server.engine.request import ErrorKind, ScoreResult
from teacher_server.engine.scheduler import Scheduler
from teacher_server.engine.sequence import Chunk, Sequence
from teacher_server.engine.stats import StepTiming, StepTrace
from teacher_server.engine.tp_workers import TPWorkers

log = logging.getLogger("teacher_server.engine.engine")  # the engine's log, wherever its code lives


class Stepping:
    """The step loop of ``Engine`` (its base class), over the engine's scheduler, model runner
    and tensor-parallel workers; a failed step's requests are failed through the engine's
    ``abort_request``. The attributes below are the engine's."""

    runner: ModelRunner
    _scheduler: Scheduler
    _workers: TPWorkers | None
    _seqs: dict[int, Sequence]  # by ScoreRequest.uid
    _inflight: InFlightStep | None  # launched, not yet completed (pipelined)
    _planned: deque[PlannedStep]  # sent to the other ranks, not yet launched here (pipeline parallel)
    _plan_depth: int  # steps planned at once: the pipeline's stages (1 without pipeline parallel)
    _failed: list[ScoreResult]  # results of a step that failed at launch
    _pipeline: bool
    _run_ahead: int | None
    _timing: StepTiming
    _steps: int
    _tokens: int
    _trace: StepTrace | None
    _tracing: bool

    def step(self, deliver: Callable[[list[ScoreResult]], None] | None = None) -> list[ScoreResult]:
        """Complete one forward step; return the results of requests that finished (or failed).

        Pipelined (``pipeline``, the default): the step completed here was launched by the
        previous call, and once it is half done this call schedules, prepares and launches the
        next one, so the host work of step N+1 overlaps the GPU work of step N. (Launching it
        earlier would fill the GPU's launch queue and block inside kernel launches, holding
        the GIL that the server's event loop needs; half a step ahead is ample. Within a
        forward, ``LaunchPacer`` keeps the host a few layers ahead for the same reason.) Step
        N is completed inside that launch, when it first waits for the GPU: N's results are
        ready by then (``Handoff``). With ``deliver``, they are handed to it right there; the
        rest are returned. The scheduler's bookkeeping for a step (progress, prefix-cache
        blocks, freed blocks) is done at launch: the GPU runs steps in launch order on one
        stream, so a later step may reuse blocks or cached KV of an earlier one that has not
        finished."""
        results = self.take_failed()
        cur = self._inflight if self._inflight is not None else self.launch()
        self._inflight = None
        if cur is not None:
            if self._pipeline:
                t0 = time.perf_counter()
                cur.pending.pacer.wait_half()
                self._timing.wait_s += time.perf_counter() - t0
                handoff = Handoff(cur, self.complete, deliver)
                self._inflight = self.launch(handoff)
                results += self._finish(handoff)
            else:
                results += self.complete(cur)
        results += self.take_failed()
        return results

    def launch(self, handoff: Handoff | None = None) -> InFlightStep | None:
        """Plan steps (``plan``), then launch the oldest planned one on this rank (asynchronous
        on CUDA); None when there is nothing to run or the step failed at launch (its requests
        failed, see ``step``). ``handoff``: the step in flight, completed at this launch's
        first wait for the GPU (by ``_finish`` after it when the launch never waits)."""
        self.plan()
        if not self._planned:
            return None
        tm = self._timing
        p = self._planned.popleft()
        pacer = self._pacer(handoff)
        t2 = time.perf_counter()
        try:
            pending = self.runner.launch(p.hs, pacer)
        except Exception as e:
            self._fail_step(p.chunks, e)
            return None
        t3 = time.perf_counter()
        # waits for the GPU inside the launch count as wait; completing the previous step
        # there counts as its own wait and scatter (``complete``)
        launch_s = t3 - t2 - pacer.wait_s - pacer.first_wait_s
        tm.launch_s += launch_s
        tm.wait_s += pacer.wait_s
        if p.trace is not None:
            p.trace["launch_ms"] = round(1e3 * launch_s, 2)
        done = p.done if p.done is not None else self._scheduler.finish_step(p.chunks)
        after = handoff.step.pending.pacer.done if handoff is not None else None
        return InFlightStep(p.chunks, p.hs, pending, done, after, p.trace)

    def plan(self) -> None:
        """Schedule and prepare steps until ``_plan_depth`` are planned and not launched here,
        handing each to the other ranks at once. With pipeline parallel (depth: the stages) the
        first stages so run up to depth - 1 steps ahead of this rank, the last stage: each
        stage runs the steps in the order planned, so a step that reads KV an earlier one writes
        (a later chunk of a sequence, a prefix cached by an earlier step) finds it written on
        every stage, as on one GPU's stream. The scheduler's bookkeeping of a step is done here
        when more steps are planned after it (``step`` says why that is safe); planning one at a
        time it waits for the launch, so that a step that fails to launch leaves no blocks in
        the prefix cache that its KV was to fill."""
        tm = self._timing
        while len(self._planned) < self._plan_depth:
            t0 = time.perf_counter()
            launched_at = time.monotonic()  # (the step trace's clock)
            chunks = self._scheduler.schedule()
            t1 = time.perf_counter()
            tm.schedule_s += t1 - t0
            if not chunks:
                return
            try:
                hs = self.runner.prepare(chunks)
                if self._workers is not None:
                    self._workers.send(hs)
            except Exception as e:
                self._fail_step(chunks, e)
                if self._plan_depth == 1:  # (one step at a time: this launch ends, as before)
                    return
                continue
            tm.prepare_s += time.perf_counter() - t1
            tokens = sum(c.end - c.start for c in chunks)
            self._steps += 1
            self._tokens += tokens
            # (before finish_step moves the sequences on)
            facts = self._trace.at_launch(self._steps, chunks, self._scheduler.num_waiting, launched_at,
                                          0.0) if self._tracing else None
            done = self._scheduler.finish_step(chunks) if self._plan_depth > 1 else None
            self._planned.append(PlannedStep(chunks, hs, done, tokens, facts))

    def _pacer(self, handoff: Handoff | None) -> Pacer:
        if self._run_ahead is None:
            return Unpaced()
        return LaunchPacer(self._run_ahead, handoff.run if handoff is not None else None)

    def complete(self, step: InFlightStep) -> list[ScoreResult]:
        """Wait for a launched step and copy its results into the requests' arrays; the
        results of the requests it finished."""
        t0 = time.perf_counter()
        try:
            out = self.runner.collect(step.pending)
            t1 = time.perf_counter()
            self.runner.scatter_results(step.hs.scoring, out)
        except Exception as e:
            self._fail_step(step.chunks, e)
            return []
        t2 = time.perf_counter()
        self._timing.wait_s += t1 - t0
        self._timing.scatter_s += t2 - t1
        busy, idle = step.pending.pacer.gpu_seconds(step.after)  # all its events are complete now
        self._timing.gpu_s += busy
        self._timing.gpu_idle_s += idle
        if step.trace is not None:
            self._trace.write(step.trace, busy, idle)
        now = time.monotonic()
        results = []
        for seq in step.done:
            if seq.result.error is not None:  # aborted while its last step ran: already answered
                continue
            self._seqs.pop(seq.req.uid, None)
            seq.result.cached_tokens = seq.num_cached
            seq.result.finished_at = now
            results.append(seq.result)
        return results

    def _finish(self, handoff: Handoff) -> list[ScoreResult]:
        """After a launch: complete the handed-off step if the launch did not (CPU, a short
        forward, nothing launched), and raise what completing it raised."""
        if not handoff.ran:
            handoff.run()
        if handoff.error is not None:
            raise handoff.error
        return handoff.results

    def take_failed(self) -> list[ScoreResult]:
        """The results of requests a failed step failed, not yet returned by ``step`` (it raised:
        the failure is fatal)."""
        out, self._failed = self._failed, []
        return out

    def _fail_step(self, chunks: list[Chunk], e: Exception) -> None:
        """Fail only this step's requests; the engine goes on serving (unless CUDA is gone)."""
        log.exception("forward step failed; failing its %d request(s)", len(chunks))
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        for c in chunks:
            self._scheduler.abort(c.seq)  # also frees blocks of a sequence already finished at launch
            if self._seqs.get(c.seq.req.uid) is c.seq:
                r = self.abort_request(c.seq.req.uid, ErrorKind.INTERNAL, f"inference failed: {type(e).__name__}")
                if r is not None:
                    self._failed.append(r)
        if is_fatal(e) or self._workers is not None:  # ranks may be out of step: no way on
            raise e
