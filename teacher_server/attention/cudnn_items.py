"""The items of the cudnn backend's step plans besides varlen calls (``cudnn``), the cudnn_fe
backend's calls and their per-sequence columns (``cudnn_fe``), and the error that says cuDNN
refused a shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from teacher_server.attention.packed import cums


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


def ragged_columns(q_lens: list[int], k_lens: list[int], t0: int, prefixed: bool, bp: int,
                   strides: tuple[int, int, int, int]) -> tuple[list[list[int]], list[list[int]]]:
    """The per-sequence columns of one call over sequences whose queries start at row t0 of
    q (and of the output): (lengths [queries, keys], element offsets [q, k, v, output]),
    each column W = bp + 1 rounded up to 4 long (16-byte aligned), sequences past the real
    ones empty (length 0, offsets at the end). Keys start at row 0 of the packed keys
    (prefixed) or at the queries' rows of the step's keys (fresh). ``strides``: the rows'
    element strides of q, k, v and the output."""
    w = -(-(bp + 1) // 4) * 4
    qo = [t0 + c for c in cums(q_lens)]
    ko = cums(k_lens) if prefixed else qo
    lens = [(ls + [0] * w)[:w] for ls in (q_lens, k_lens)]
    qo, ko = ((o + [o[-1]] * w)[:w] for o in (qo, ko))
    return lens, [[o * st for o in row] for row, st in zip((qo, ko, ko, qo), strides)]


@dataclass
class FeCall:
    """One cuDNN call over sequences [i, j) of one part (queries q[t0:t1])."""

    prefixed: bool
    t0: int
    t1: int
    key: tuple  # the graph's class: (prefixed, sequences, longest queries, longest keys)
    lens: torch.Tensor  # int32 [2, W]: each sequence's queries, keys (W: sequences + 1, rounded up to 4)
    offs: torch.Tensor  # int64 [4, W]: where each sequence starts in q, k, v, the output (elements)
