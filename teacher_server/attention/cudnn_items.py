"""The items of the cudnn backend's step plans besides varlen calls (``cudnn``), and the error
that says cuDNN refused a shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Fresh:
    """cuDNN causal attention of one fresh sequence: tokens [t0, t0 + n)."""

    t0: int
    n: int


@dataclass
class Prefixed:
    """cuDNN attention of one prefixed sequence: queries q[t0:t0+c], keys kp[k0:k0+p+c]
    (p of them before the queries)."""

    t0: int
    c: int
    k0: int
    p: int


@dataclass
class Group:
    """cuDNN attention of neighbouring prefixed sequences whose first s keys are the same
    pool entries: one non-causal call for all their queries (q[t0 : t0 + sum(cs)]) against
    those s keys, then per sequence i a causal square over its keys kp[k0s[i] + s :
    k0s[i] + ps[i] + cs[i]], merged by log-sum-exp."""

    t0: int
    cs: list[int]
    k0s: list[int]
    ps: list[int]
    s: int


class PathFailed(Exception):
    """cuDNN refused a shape (not out of memory, not a broken context)."""

    def __init__(self, path: str, err: Exception) -> None:
        super().__init__(path)
        self.path, self.reason = path, " ".join(str(err).split())[:200]


def not_a_shape_problem(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA error" in str(e)
