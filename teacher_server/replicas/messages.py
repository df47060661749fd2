"""Typed messages between the front and a replica process (pickled through multiprocessing
pipes), and what a replica reports about itself when it is ready."""

from __future__ import annotations

from dataclasses import dataclass

from teacher_server.engine.request import ScoreRequest, ScoreResult
from teacher_server.engine.stats import EngineStats


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front needs of a built engine (the same for every replica)."""

    served_model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int


# --- front -> replica ----------------------------------------------------------------------
@dataclass
class AddMsg:
    """Score a request (admitted by the front: it counts against this replica's queue)."""

    req: ScoreRequest


@dataclass
class CancelMsg:
    """Its caller stopped waiting: abort it and free its KV (no answer is sent)."""

    uid: int


@dataclass
class StopMsg:
    """Shut the engine down and exit (the front has drained what it wanted)."""


ToReplica = AddMsg | CancelMsg | StopMsg


# --- replica -> front ----------------------------------------------------------------------
@dataclass
class ReadyMsg:
    info: ReplicaInfo


@dataclass
class StartFailedMsg:
    error: str


@dataclass
class ResultMsg:
    res: ScoreResult


@dataclass
class LostMsg:
    """The engine died holding this request: it was not scored, send it elsewhere."""

    uid: int


@dataclass
class StatsMsg:
    stats: EngineStats


FromReplica = ReadyMsg | StartFailedMsg | ResultMsg | LostMsg | StatsMsg
