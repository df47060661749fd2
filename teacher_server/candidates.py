"""The rules a candidates value (``prompt_logprob_token_ids``) follows: one module for the
server's validation, the in-process ``LLM`` and the client, so they cannot drift apart.

A value is a flat list of K ids shared by every scored row, a list of per-row lists of K ids
(``-1`` pads), or an integer array of shape ``[K]`` or ``[rows, K]`` (the server also takes
that array as a base64 ``.npy`` string; ``teacher_server.validation`` decodes it first).
``candidate_ids`` checks what the value alone tells (shape, K >= 1, equal rows, integer ids);
the bounds need what a caller knows: the server and the ``LLM`` know the vocabulary, the row
count and the limits (``check_candidate_bounds``), the client only its int32 wire format
(``check_int32``). The integer rule is the token ids' too (``integer_ids``).

numpy and the standard library only: the client's install (numpy, httpx) has no torch,
pydantic or FastAPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Candidates = Sequence[int] | Sequence[Sequence[int]] | np.ndarray
_INT32 = np.iinfo(np.int32)
_INT64_MAX = np.iinfo(np.int64).max


def is_whole(value: Any) -> bool:
    """An integer as a row index or a count: a Python or numpy int, not a bool (1.5 and "4" are
    not; ``int()`` of them would quietly score other rows)."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


class InvalidIds(ValueError):
    """Ids that can never be valid; the message names them as the caller calls them."""


class NonIntegerIds(InvalidIds, TypeError):
    """Ids that are not integers: floats, bools, strings, values beyond 64 bits."""


def integer_ids(value: Any, name: str) -> np.ndarray:
    """``value`` as an array of integer ids, in the dtype numpy gives it (a list of Python ints:
    int64). Floats are not cut to integers and bools are not ids 0/1, in lists and arrays alike;
    an empty value passes (its shape says what is wrong with it)."""
    try:
        arr = np.asarray(value)
    except (OverflowError, ValueError, TypeError):  # rows of rows of unequal depth, ...
        raise InvalidIds(f"{name} must be a list of integer ids (or a list of equal-length rows)") from None
    if arr.dtype.kind in "iu" and not isinstance(value, np.ndarray) and _holds_bool(value):
        raise NonIntegerIds(f"{name} must hold integer ids, not True/False")  # (numpy made 1/0 of them)
    if arr.size and arr.dtype.kind not in "iu":  # object: ids beyond 64 bits, or values of mixed types
        big = None if isinstance(value, np.ndarray) else _beyond_int64(value)
        if big is not None:  # (integers all: numpy made floats of [1, 2**63], "dtype float64" would mislead)
            raise NonIntegerIds(f"{name}: id {big} is out of range")
        raise NonIntegerIds(f"{name} must hold integer ids within int64, got dtype {arr.dtype}")
    return arr


def _holds_bool(value: Any) -> bool:
    """Whether a list (or list of rows) mixing bools with ints holds a bool: numpy's integer
    array of it reads True as id 1."""
    if not isinstance(value, list | tuple):
        return False
    return any(isinstance(x, bool | np.bool_) or (isinstance(x, np.ndarray) and x.dtype == np.bool_)
               for row in value for x in (row if isinstance(row, list | tuple) else (row,)))


def _beyond_int64(value: Any) -> int | None:
    """The first id int64 cannot hold of a list (or list of rows) of Python ints only; None
    when there is none, or another value (a float, a bool, a string)."""
    if not isinstance(value, list | tuple):
        return None
    flat = [x for row in value for x in (row if isinstance(row, list | tuple) else (row,))]
    if not all(type(x) is int for x in flat):
        return None
    return next((x for x in flat if not -_INT64_MAX - 1 <= x <= _INT64_MAX), None)


def signed_ids(arr: np.ndarray, name: str) -> np.ndarray:
    """Signed ids as given (compared as sent: no widened copy); unsigned ones as int64, where
    one beyond int64 is refused (2**64 - 1 would wrap to -1, the pad)."""
    if arr.dtype.kind == "u" and arr.size and arr.max() > _INT64_MAX:
        raise InvalidIds(f"{name}: id {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False) if arr.dtype.kind == "u" else arr


def candidate_ids(value: Any, name: str = "candidates") -> np.ndarray:
    """Candidates in any form -> an integer array of shape ``[K]`` (shared by every scored row)
    or ``[rows, K]`` (one row per scored position, ``-1`` pads), in the dtype given.

    K must be at least 1 in every form (also with zero rows), every row must hold K ids, ids
    must be integers. Raises ``InvalidIds`` (a ValueError; ``NonIntegerIds``, also a
    TypeError, for ids that are not integers).
    """
    if not isinstance(value, np.ndarray):
        _check_rows(value, name)
    arr = integer_ids(value, name)
    if arr.ndim not in (1, 2):
        raise InvalidIds(f"{name} must have shape [K] or [rows, K], got {list(arr.shape)}")
    if arr.shape[-1] == 0:
        raise InvalidIds(f"{name}: K must be at least 1 in every form, got shape {list(arr.shape)} "
                         "(zero rows with K candidates are a flat list of K ids or a [0, K] array)")
    return arr


def _check_rows(value: Any, name: str) -> None:
    """Ragged rows would become numpy's 'inhomogeneous shape' error: say which row differs."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        return
    nested = [_is_row(r) for r in value]
    if any(nested) and not all(nested):
        raise InvalidIds(f"{name}: a mix of ids and rows; give a flat list of K ids or a list of rows")
    if not nested[0]:
        return
    k0 = len(value[0])
    for i, row in enumerate(value):
        if len(row) != k0:
            raise InvalidIds(f"{name}: every row must hold the same number of ids (pad with -1); "
                             f"row 0 has {k0}, row {i} has {len(row)}")


def _is_row(r: Any) -> bool:
    # lists first: a JSON body's rows, where the check against the Sequence ABC costs most
    return isinstance(r, (list, tuple, np.ndarray)) or (isinstance(r, Sequence) and not isinstance(r, (str, bytes)))


def check_candidate_bounds(arr: np.ndarray, *, rows: int, vocab_size: int, max_logprobs: int,
                           max_rows_x_k: int, name: str) -> None:
    """The bounds of checked candidates (``candidate_ids``, then ``signed_ids``) for a request
    of ``rows`` scored rows: K within ``max_logprobs``, a row per scored row, ids in
    ``[0, vocab_size)`` (``-1`` pads rows; a shared ``[K]`` has nothing to pad), rows * K within
    ``max_rows_x_k``."""
    k = arr.shape[-1]
    if k > max_logprobs:
        raise InvalidIds(f"{name}: K={k} exceeds max_logprobs={max_logprobs}")
    per_row = arr.ndim == 2
    if per_row and arr.shape[0] != rows:
        raise InvalidIds(f"{name}: got {arr.shape[0]} candidate rows, expected rows={rows} "
                         f"(len(token_ids) - 1 - prompt_logprob_start)")
    bad = (arr < (-1 if per_row else 0)) | (arr >= vocab_size)
    if bad.any():
        pads = " (-1 pads)" if per_row else ""
        raise InvalidIds(f"{name}: id {int(arr[bad][0])} is outside [0, {vocab_size}){pads}")
    if rows * k > max_rows_x_k:
        raise InvalidIds(f"{name}: rows*K={rows * k} exceeds the limit {max_rows_x_k}")


def check_int32(arr: np.ndarray, name: str = "candidates") -> None:
    """The client's bound: candidates travel as int32 (the server's vocabulary is not known
    there; every id it accepts fits)."""
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise InvalidIds(f"{name}: ids must fit in int32")
