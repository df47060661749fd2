"""Tuning: the switches of a built engine that may change between runs (the benchmark's
ablations take one optimisation away at a time; tests pick a backend or a pacing depth).

    saved = engine.tuning
    engine.tuning = dataclasses.replace(saved, pipeline=False)
    ...
    engine.tuning = saved
"""

from __future__ import annotations

from dataclasses import dataclass

from teacher_server.attention.base import AttentionBackend


@dataclass(frozen=True)
class Tuning:
    pipeline: bool  # launch step N+1 while step N runs (Engine.step)
    token_budget: int  # max tokens of one step (the scheduler's budget)
    whole_fill: float  # share of the budget from which a sequence that fits a step is not split to fill (1: always)
    prefix_caching: bool  # reuse cached prompt KV (applies to requests added afterwards)
    residual_in_gemm: bool  # the residual add in the o/down GEMM epilogue (FusedOps)
    last_layer_rows_only: bool  # after the last layer's mixer, only rows that reach the LM head (the model)
    run_ahead: int | None  # layers the host may queue ahead of the GPU in a forward; None: unpaced (CPU)
    attention: AttentionBackend  # the attention backend the forward uses
