"""The HTTP status of each engine error kind, and the Retry-After of those a retry gets past:
the one table the server answers with."""

from __future__ import annotations

from teacher_server.engine.request import ErrorKind

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.TIMEOUT: 504,
    ErrorKind.CANCELLED: 499,  # nginx's "client closed request": nobody reads it
    ErrorKind.INTERNAL: 500,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
}
assert set(HTTP_STATUS) == set(ErrorKind), "every error kind has a status"
_RETRY_AFTER_S = {ErrorKind.OVERLOADED: "1", ErrorKind.UNAVAILABLE: "5"}


def http_status(kind: ErrorKind | None) -> int:
    """The status of a failed result (500 when it names no kind)."""
    return HTTP_STATUS.get(kind, 500) if kind is not None else 500


def retry_after(kind: ErrorKind | None) -> dict[str, str]:
    """``Retry-After`` for the errors a retry can get past: a full queue (429), a drain (503)."""
    return {"Retry-After": _RETRY_AFTER_S[kind]} if kind in _RETRY_AFTER_S else {}
