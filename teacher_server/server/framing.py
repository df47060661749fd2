"""One framing per request: h11 frames a request that gives both Transfer-Encoding and
Content-Length by the first (RFC 9112 6.1), and keeps its connection open. Two framings are how
requests are smuggled past a proxy that reads the other one; the RFC has the server refuse
such a request or close its connection after answering. Refused here: the documented 400,
and the connection closes."""

from __future__ import annotations

from typing import Any

import h11


class OneFraming:
    """An ``h11.Connection`` whose ``next_event`` raises ``h11.RemoteProtocolError`` (uvicorn
    then sends its 400, ``HeaderTimeoutProtocol.send_400_response``) for a request with both
    headers; everything else is the connection's."""

    def __init__(self, conn: h11.Connection) -> None:
        self._conn = conn
        self.refused_request_id: str | None = None  # the X-Request-Id of a request refused here

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def next_event(self) -> Any:
        event = self._conn.next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                self.refused_request_id = next((v.decode("latin-1") for k, v in event.headers
                                                if k == b"x-request-id"), None)
                raise h11.RemoteProtocolError("both Transfer-Encoding and Content-Length: one framing is read")
        return event
