"""A step planned and sent to the pipeline's earlier stages (``PlannedStep``), a launched
step (``InFlightStep``) and its hand-off to the next launch (``Handoff``): what
``Engine.launch`` returns and what ``Engine.step`` passes from one launch to the next when
pipelined."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from teacher_server.engine.host_step import HostStep
from teacher_server.engine.model_runner import PendingOutput
from teacher_server.engine.request import ScoreResult
from teacher_server.engine.sequence import Chunk, Sequence


@dataclass
class PlannedStep:
    """A step scheduled, prepared and handed to the other ranks (its bookkeeping done), not yet
    launched on this rank: under pipeline parallel the first stages already run it while this
    rank, the last stage, runs the steps before it."""

    chunks: list[Chunk]
    hs: HostStep
    done: list[Sequence] | None  # sequences this step completes (their bookkeeping done); None: not yet done
    tokens: int
    trace: dict | None = None  # its step-trace facts (``StepTrace.at_launch``) when tracing


@dataclass
class InFlightStep:
    """A launched step, not yet completed."""

    chunks: list[Chunk]
    hs: HostStep
    pending: PendingOutput
    done: list[Sequence]  # sequences this step completes (their bookkeeping is done)
    after: torch.cuda.Event | None = None  # end of the step that was in flight at launch
    trace: dict | None = None  # its step-trace facts (``StepTrace.at_launch``) when tracing


class Handoff:
    """The step in flight when the next one is launched, and what became of it: ``run``
    completes it (``Engine.complete``) and hands its results to ``deliver`` when given,
    else keeps them in ``results``. The next launch's pacer runs it at its first wait for
    the GPU. An error there is kept, not raised: it must not be taken for a failure of the
    launch around it (``step`` raises it after the launch)."""

    def __init__(self, step: InFlightStep, complete: Callable[[InFlightStep], list[ScoreResult]],
                 deliver: Callable[[list[ScoreResult]], None] | None) -> None:
        self.step = step
        self.complete = complete
        self.deliver = deliver
        self.ran = False
        self.results: list[ScoreResult] = []  # returned by Engine.step (those not delivered)
        self.error: BaseException | None = None

    def run(self) -> None:
        assert not self.ran, "a step is completed once"
        self.ran = True
        try:
            res = self.complete(self.step)
            if self.deliver is not None:
                self.deliver(res)
                res = []
            self.results = res
        except BaseException as e:
            self.error = e
