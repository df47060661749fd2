"""What the engine reports about itself: per-stage time (``StepTiming``), one snapshot of
its counters and queues (``EngineStats``), read by the metrics and the benchmarks, and, when
asked for, a line per step (``StepTrace``)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class StepTiming:
    """Engine-thread time per stage of the steps, summed (seconds). The host stages:
    schedule, prepare, launch (queueing GPU work), wait (for the GPU), scatter (results to
    requests). On CUDA also the GPU's view (CUDA events): ``gpu_idle_s``, time the GPU had
    run out of queued work while the host was still launching (inside a step, or between a
    step and the one launched behind it); ``gpu_s``, the rest of each step's span, first
    kernel to results on the host."""

    schedule_s: float = 0.0
    prepare_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    scatter_s: float = 0.0
    gpu_s: float = 0.0
    gpu_idle_s: float = 0.0

    def stages(self) -> dict[str, float]:
        """The host stages by name (the ``stage`` label of the metrics): seconds."""
        return {"schedule": self.schedule_s, "prepare": self.prepare_s, "launch": self.launch_s,
                "wait": self.wait_s, "scatter": self.scatter_s}

    def minus(self, earlier: StepTiming) -> StepTiming:
        """The time spent since ``earlier`` (a copy taken before)."""
        return StepTiming(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def copy(self) -> StepTiming:
        return replace(self)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (``Engine.stats()``); counters are totals since start."""

    timing: StepTiming
    steps: int  # forward steps launched
    computed_tokens: int  # tokens run through the model (cache hits excluded)
    waiting: int  # requests queued, not yet scheduled
    running: int  # requests part-way through a chunked prefill
    active_requests: int  # admitted and not yet answered (waiting, running, in a step in flight)
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int  # cacheable prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of which served from it
    # Linear-attention state slots of a hybrid model (0 for other models), the zero slot not counted.
    state_slots_total: int = 0
    state_slots_used: int = 0  # held by sequences or holding a snapshot
    state_snapshots: int = 0  # prompt snapshots kept for prefix reuse (bound to prefix-cache blocks)
    token_budget: int = 0  # tokens one forward step holds (configured, or chosen from the memory)
    kv_tokens_total: int = 0  # KV token slots of the pool (per rank; each holds its share of the heads)
    # each kernel switch (``ops.fused.SWITCHES``) and whether the warm-up left it on (rank 0's)
    kernels: tuple[tuple[str, bool], ...] = ()

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use (0-1)."""
        return self.kv_blocks_used / self.kv_blocks_total


class StepTrace:
    """One JSON line per forward step, appended to a file (``Config.step_trace``). What is
    known at launch (``at_launch``) travels with the step; the line is written when the step
    completes, with its GPU time. ``at``: seconds since ``begin``; ``clock``:
    ``time.monotonic()`` at launch and completion. A write that fails turns the trace off
    (one warning)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        try:
            self._file = self.path.open("a", buffering=1)  # line-buffered: one append per step's line
        except OSError as e:
            raise ValueError(f"step_trace: cannot append to {path}: {e.strerror or e}") from e
        self._t0 = time.monotonic()
        self._pid = os.getpid()  # replicas append to the same file

    def begin(self) -> None:
        """The first step to trace is next: ``at`` counts from now."""
        self._t0 = time.monotonic()

    def at_launch(self, index: int, chunks: list, waiting: int, launched_at: float, launch_s: float) -> dict[str, Any]:
        """The step's make-up (``chunks``: its ``Chunk``s, before the scheduler moves them on),
        when its launch began (``time.monotonic()``) and the host time it took; ``arrived``: the
        earliest and latest arrival (``time.monotonic()`` once the server had parsed it) of its
        requests; through HTTP also ``received`` (the server began handling them) and ``read``
        (their bodies were whole); ``handed``: when the engine's process queued them for the engine
        thread (for a replica, after the pipe from the server's process)."""
        span = {}
        for key, name in (("arrived", "arrival"), ("received", "received"), ("read", "body_read"),
                          ("handed", "handed")):
            ts = [t for c in chunks if (t := getattr(c.seq.req, name)) is not None]
            if ts or key == "arrived":
                span[key] = [round(min(ts), 4), round(max(ts), 4)] if ts else None
        return {**span,
                "step": index, "tokens": sum(c.end - c.start for c in chunks), "seqs": len(chunks),
                "continuing": sum(1 for c in chunks if c.start > 0),  # after an earlier chunk or a cached prefix
                "unfinished": sum(1 for c in chunks if not c.final),  # go on in a later step
                "scored_rows": sum(max(0, c.logit_hi - c.logit_lo) for c in chunks), "waiting": waiting,
                "at": round(launched_at - self._t0, 4), "launch_ms": round(1e3 * launch_s, 2),
                "clock": [round(launched_at, 4)]}

    def write(self, facts: dict[str, Any], gpu_s: float, idle_s: float) -> None:
        """The line of a completed step: its ``at_launch`` facts and its GPU time."""
        if self._file is None:
            return
        line = dict(facts, gpu_ms=round(1e3 * gpu_s, 2), gpu_idle_ms=round(1e3 * idle_s, 2),
                    # the host clock (CLOCK_MONOTONIC, shared by the host's processes) at launch and completion
                    clock=[*facts["clock"], round(time.monotonic(), 4)], pid=self._pid)
        try:
            self._file.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as e:
            log.warning("step trace %s: %s; no more steps are traced", self.path, e)
            self.close()

    def close(self) -> None:
        """Close the file; a failure to flush its last line is not the engine's concern."""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except (OSError, ValueError):
                pass
