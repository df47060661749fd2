"""``AsyncTeacherClient``: the asyncio client, usable from any number of event loops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import httpx
import numpy as np

from teacher_server.client.base import ClientBase
from teacher_server.client.padding import PaddedScores, pad_scores
from teacher_server.client.progress import Progress
from teacher_server.client.protocol import (
    Candidates,
    RequestLike,
    ScoreOutput,
    Targets,
    TeacherRequest,
    as_request,
)
from teacher_server.routing import BLOCK_SIZE, SPILL_TOKENS, Routing


@dataclass
class _LoopState:
    """What belongs to one event loop: pooled connections and the concurrency limit."""

    http: httpx.AsyncClient
    slots: asyncio.Semaphore
    closer: AsyncGenerator[None, None]


async def _closer(http: httpx.AsyncClient) -> AsyncGenerator[None, None]:
    """Started once per loop and left suspended: ``asyncio.run`` closes a loop's unfinished
    async generators before it closes the loop, which closes that loop's connections while
    they can still be closed (a loop ended without ``aclose()`` leaks no sockets)."""
    try:
        yield
    finally:
        await http.aclose()


class AsyncTeacherClient(ClientBase):
    """Asyncio client with ``TeacherClient``'s surface (``await client.score(...)``).

    Connections and the concurrency limit belong to an event loop, so they are made on first
    use in each loop, not at construction: one client serves successive ``asyncio.run`` calls
    (or loops in several threads). At most ``max_concurrency`` requests are in flight at once
    per loop. ``aclose()`` closes the current loop's connections, ``asyncio.run`` closes them
    when its loop ends, and ``async with`` does both that and ``close()``. ``transport``: an
    ``httpx.AsyncBaseTransport``, for one event loop (it is closed with that loop's connections),
    or a callable returning one, called for each loop. Several servers (``base_url`` a list, or
    ``resolve=True``) as in ``TeacherClient``; ``close()`` stops their health checks.
    """

    def __init__(self, base_url: str | Sequence[str], api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 600.0, max_retries: int = 5, backoff: float = 0.5,
                 max_concurrency: int = 16, *, max_backoff: float = 30.0, model: str | None = None,
                 transport: httpx.AsyncBaseTransport | Callable[[], httpx.AsyncBaseTransport] | None = None,
                 resolve: bool = False,
                 routing: Routing = "affinity", block_size: int = BLOCK_SIZE, spill_tokens: int = SPILL_TOKENS,
                 health_interval: float = 5.0) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, backoff, max_backoff, max_concurrency, model,
                         resolve=resolve, routing=routing, block_size=block_size, spill_tokens=spill_tokens,
                         health_interval=health_interval)
        self._transport = transport
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._lock = threading.Lock()  # loops in several threads may share the client

    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._lock:
            for dead in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[dead]  # closed with its loop (see _closer)
            st = self._loops.get(loop)
            if st is not None:
                return st
            transport = self._transport
            if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
                transport = transport()  # a factory: this loop's own
            http = httpx.AsyncClient(transport=transport, **self._client_kw)
            st = self._loops[loop] = _LoopState(http, asyncio.Semaphore(self.max_concurrency), _closer(http))
        await st.closer.__anext__()  # runs to its yield: now the loop tracks it
        return st

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        await asyncio.to_thread(self.close)  # (it waits for a health check under way: not on the loop)

    def close(self) -> None:
        """Stop the health checks of several servers (``aclose`` closes a loop's connections);
        they start again if the client is used again."""
        if self.endpoints is not None:
            self.endpoints.close()

    async def aclose(self) -> None:
        """Close this event loop's pooled connections (the client stays usable)."""
        with self._lock:
            st = self._loops.pop(asyncio.get_running_loop(), None)
        if st is not None:
            await st.closer.aclose()  # its finally closes the connections

    async def score(self, token_ids: Sequence[int] | np.ndarray, candidates: Candidates, start: int = 0, *,
                    cache_salt: str | None = None, request_id: str | None = None,
                    prompt_logprobs: int | None = None, max_tokens: int = 0, priority: int = 0,
                    model: str | None = None) -> np.ndarray:
        """See ``TeacherClient.score``."""
        out = await self.score_full(token_ids, candidates, start, cache_salt=cache_salt, request_id=request_id,
                                    prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, priority=priority,
                                    model=model)
        return out.scores

    async def score_full(self, token_ids: Sequence[int] | np.ndarray, candidates: Candidates | None, start: int = 0,
                         *, cache_salt: str | None = None, request_id: str | None = None,
                         prompt_logprobs: int | None = None, max_tokens: int = 0,
                         priority: int = 0, targets: Targets | None = None, model: str | None = None) -> ScoreOutput:
        """See ``TeacherClient.score_full``."""
        return await self._send(TeacherRequest(token_ids, candidates, start, cache_salt, request_id,
                                               prompt_logprobs, max_tokens, priority, targets, model))

    async def score_batch(self, requests: Iterable[RequestLike], *, progress: bool = False,
                          return_exceptions: bool = False) -> list[np.ndarray | Exception]:
        """See ``TeacherClient.score_batch``."""
        outs = await self.score_batch_full(requests, progress=progress, return_exceptions=return_exceptions)
        return [o if isinstance(o, Exception) else o.scores for o in outs]

    async def score_batch_full(self, requests: Iterable[RequestLike], *, progress: bool = False,
                               return_exceptions: bool = False) -> list[ScoreOutput | Exception]:
        """See ``TeacherClient.score_batch_full``."""
        reqs = [as_request(r) for r in requests]
        bar = Progress(len(reqs), progress)
        tasks = [asyncio.ensure_future(self._send(r)) for r in reqs]
        for t in tasks:
            t.add_done_callback(lambda t: t.cancelled() or bar.update())
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for t in tasks:  # after a failure: do not leave the others running
                t.cancel()
            bar.close()

    async def score_batch_padded(self, requests: Iterable[RequestLike], *, length: int | None = None,
                                 fill: float = 0.0, return_tensors: Literal["np", "pt"] = "np",
                                 progress: bool = False) -> PaddedScores:
        """See ``TeacherClient.score_batch_padded``."""
        results = await self.score_batch(requests, progress=progress)
        # without return_exceptions every entry is a matrix
        return pad_scores(cast(list[np.ndarray], results), length=length, fill=fill, return_tensors=return_tensors)

    async def _send(self, req: TeacherRequest) -> ScoreOutput:
        """One request with its retries (``Attempts``, as ``TeacherClient``'s)."""
        # Encoded once a slot is held: in a batch every task runs to its first wait before the
        # loop sends anything, so encoding them all up front would hold the first request back
        # until the last body was encoded (about 0.35 s for 128 W1 requests on a 2-core CPU).
        content: bytes | None = None
        st = await self._state()
        attempts = self._attempts(req)
        while True:
            with attempts.sending() as url:
                async with st.slots:
                    if content is None:
                        content = self._encode(req)
                    path, headers, extensions = self._post_args(url)
                    attempts.resp = await st.http.post(path, content=content, headers=headers,
                                                       extensions=extensions)
            out = attempts.outcome()
            if out is not None:
                return out
            wait = attempts.backoff()
            if wait is not None:
                await asyncio.sleep(wait)
