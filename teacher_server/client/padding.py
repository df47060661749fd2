"""Per-request ``[rows, K]`` results as one padded ``[B, T, K]`` batch with its row mask,
the layout trainers that batch their loss use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


@dataclass(frozen=True)
class PaddedScores:
    """``scores[b, t]`` is row t of request b (the score of its token ``start + t + 1``,
    i.e. response position t when ``start = len(prompt) - 1``); rows past a request's own
    count hold ``fill`` and are False in ``mask``. numpy arrays, or torch tensors when asked."""

    scores: Any  # [B, T, K] float32
    mask: Any  # [B, T] bool: True where the row is real


def pad_scores(results: Sequence[np.ndarray], *, length: int | None = None, fill: float = 0.0,
               return_tensors: Literal["np", "pt"] = "np") -> PaddedScores:
    """Stack ``[rows_b, K]`` matrices into ``[B, T, K]``, ``T = max(rows_b)`` (or ``length``).

    ``fill`` goes in padded rows; 0.0 keeps ``scores * mask`` free of NaN, which ``-inf``
    would not be. ``-inf`` from ``-1`` candidate padding inside real rows is kept as the
    server sent it. ``return_tensors="pt"`` gives torch tensors (torch must be installed).
    Every matrix must have the same K. ``[rows_b]`` vectors (a ``ScoreOutput``'s
    ``actual_logprobs``, ``tail_logprobs``, ``logsumexp``) stack into ``[B, T]`` the same way.
    """
    if return_tensors not in ("np", "pt"):
        raise ValueError(f"return_tensors must be 'np' or 'pt', got {return_tensors!r}")
    ndims = {np.ndim(r) for r in results}
    if len(ndims) > 1 or not ndims <= {1, 2}:
        raise ValueError(f"results must be all [rows, K] matrices or all [rows] vectors, got {sorted(ndims)} "
                         "dimensions")
    ks = {int(r.shape[1]) for r in results} if ndims == {2} else set()
    if len(ks) > 1:
        raise ValueError(f"results have different K ({sorted(ks)}); pad candidates to one K with -1 first")
    rows = [int(r.shape[0]) for r in results]
    t = max(rows, default=0) if length is None else length
    if rows and max(rows) > t:
        raise ValueError(f"length={t} is shorter than the longest result ({max(rows)} rows)")
    inner = () if ndims == {1} else (ks.pop() if ks else 0,)
    scores = np.full((len(results), t, *inner), fill, dtype=np.float32)
    mask = np.zeros((len(results), t), dtype=bool)
    for b, (r, n) in enumerate(zip(results, rows)):
        scores[b, :n] = r
        mask[b, :n] = True
    if return_tensors == "pt":
        try:
            import torch
        except ImportError:
            raise ImportError("return_tensors='pt' needs torch installed; use 'np' for numpy arrays") from None
        return PaddedScores(torch.from_numpy(scores), torch.from_numpy(mask))
    return PaddedScores(scores, mask)
