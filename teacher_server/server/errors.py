"""The HTTP status of each engine error kind: the one table the server answers with."""

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


def http_status(kind: ErrorKind | None) -> int:
    """The status of a failed result (500 when it names no kind)."""
    return HTTP_STATUS.get(kind, 500) if kind is not None else 500
