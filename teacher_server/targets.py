"""The union of a request's candidates and the teacher's top-K, per scored row, in one
fixed-width form (numpy only): the candidates' columns first in the caller's order, then
the top-K ids not among that row's candidates in rank order, then ``-1`` padding (log-prob
``-inf``) up to ``Kc + Kt`` columns. Built from the two matrices the engine returns, so the
union costs no second pass over the logits."""

from __future__ import annotations

import numpy as np


def union_columns(cand: np.ndarray, cand_scores: np.ndarray, top_ids: np.ndarray,
                  top_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cand: [Kc] shared or [rows, Kc] (-1 pads); cand_scores: [rows, Kc] float32; top_ids,
    top_logprobs: [rows, Kt] -> (ids [rows, Kc + Kt] int32, log-probs [rows, Kc + Kt] float32)."""
    rows, kt = top_ids.shape
    c = np.broadcast_to(cand, (rows, cand.shape[-1])) if cand.ndim == 1 else cand
    # [rows, Kt]: top-K ids a candidate of the row already holds (those columns are not repeated)
    dup = (top_ids[:, :, None] == c[:, None, :]).any(axis=2) if rows else np.zeros((0, kt), dtype=bool)
    order = np.argsort(dup, axis=1, kind="stable")  # new ids first, in rank order
    ids = np.take_along_axis(np.where(dup, -1, top_ids), order, axis=1)
    lps = np.take_along_axis(np.where(dup, -np.inf, top_logprobs), order, axis=1)
    return (np.concatenate([c, ids], axis=1).astype(np.int32, copy=False),
            np.concatenate([cand_scores, lps], axis=1).astype(np.float32, copy=False))
