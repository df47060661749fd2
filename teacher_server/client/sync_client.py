"""``TeacherClient``: the synchronous client (requests of a batch run on a thread pool)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
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
    TeacherServerError,
    as_request,
)
from teacher_server.routing import BLOCK_SIZE, SPILL_TOKENS, Routing


class TeacherClient(ClientBase):
    """Synchronous client (thread-safe; ``score_batch`` runs requests on a thread pool).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/inference/v1/generate``
            is taken off; a URL without ``http://`` or ``https://`` raises ValueError); or several
            servers (a list of base URLs), over which requests are routed as the server routes over
            its replicas: the same unscored prefix (first token blocks + ``cache_salt``) to the same server, so a GRPO
            group's responses hit the server that caches its prompt; least outstanding tokens
            otherwise. A server that fails connections or ``/health`` is taken out (its requests
            go to another at once) and put back when ``/health`` answers 200 again.
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        timeout: seconds httpx waits at each step of an attempt (connecting, capped at 10 s; sending;
            each read of the answer), not for the attempt as a whole; None for no limit; or an
            ``httpx.Timeout``. The server's own ``request_timeout_s`` bounds a request's time there.
        max_retries: retries after the first attempt on 429/502/503/504, connection errors and timeouts.
        backoff: first backoff in seconds; doubles per retry, with jitter, up to ``max_backoff``.
            A ``Retry-After`` header is the least wait.
        max_concurrency: requests in flight at once (threads of ``score_batch``, pooled connections).
        model: sent as ``model``; the server answers 404 when it serves another one.
        transport: a custom ``httpx.BaseTransport`` (TLS settings, proxies, tests).
        resolve: route over every address ``base_url``'s host resolves to (a Kubernetes headless
            Service: one per ready pod), resolved again at each health check.
        routing: ``affinity`` (default) or ``round_robin`` (ignores prefixes; for comparisons).
        block_size: the servers' ``block_size`` (the unit of prefix reuse), 16 by default.
        spill_tokens: see ``teacher_server.routing``: when a request leaves its preferred server.
        health_interval: seconds between health checks (and DNS resolutions) of several servers.
    """

    def __init__(self, base_url: str | Sequence[str], api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 600.0, max_retries: int = 5, backoff: float = 0.5,
                 max_concurrency: int = 16, *, max_backoff: float = 30.0, model: str | None = None,
                 transport: httpx.BaseTransport | None = None, resolve: bool = False, routing: Routing = "affinity",
                 block_size: int = BLOCK_SIZE, spill_tokens: int = SPILL_TOKENS,
                 health_interval: float = 5.0) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, backoff, max_backoff, max_concurrency, model,
                         resolve=resolve, routing=routing, block_size=block_size, spill_tokens=spill_tokens,
                         health_interval=health_interval, probe_transport=transport)
        self._transport = transport
        self._http, self._pid = httpx.Client(transport=transport, **self._client_kw), os.getpid()
        self._slots = threading.BoundedSemaphore(max_concurrency)

    def _pool(self) -> httpx.Client:
        """The pooled connections of this process: a process forked from the one that made them
        (a DataLoader worker) takes a pool of its own, as two processes reading one socket take
        each other's answers. The parent's pool is left to the parent (not closed here)."""
        if os.getpid() != self._pid:
            self._http, self._pid = httpx.Client(transport=self._transport, **self._client_kw), os.getpid()
        return self._http

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections (and stop the health checks of several servers)."""
        self._http.close()
        if self.endpoints is not None:
            self.endpoints.close()

    def score(self, token_ids: Sequence[int] | np.ndarray, candidates: Candidates, start: int = 0, *,
              cache_salt: str | None = None, request_id: str | None = None, prompt_logprobs: int | None = None,
              max_tokens: int = 0, priority: int = 0, model: str | None = None) -> np.ndarray:
        """Teacher log-probs of ``candidates``: a ``[rows, K]`` float32 matrix,
        ``rows = max(len(token_ids) - 1 - start, 0)``; row i scores token ``start + i + 1``.

        ``candidates`` is ``[K]`` (shared by every row) or ``[rows, K]`` (one row per scored
        position, ``-1`` pads and scores ``-inf``), K >= 1. Raises ``TeacherServerError``, or
        ``ValueError``/``TypeError`` before sending for input that cannot be valid (K == 0,
        ragged rows, non-integer ids). ``model``: the teacher of a service of several
        (docs/teachers.md); default the client's ``model``.
        """
        return self.score_full(token_ids, candidates, start, cache_salt=cache_salt, request_id=request_id,
                               prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, priority=priority,
                               model=model).scores

    def score_full(self, token_ids: Sequence[int] | np.ndarray, candidates: Candidates | None, start: int = 0, *,
                   cache_salt: str | None = None, request_id: str | None = None,
                   prompt_logprobs: int | None = None, max_tokens: int = 0, priority: int = 0,
                   targets: Targets | None = None, model: str | None = None) -> ScoreOutput:
        """As ``score``, returning a ``ScoreOutput`` (matrix, next token, usage, prompt_logprobs, request id).
        ``targets`` (``Targets``) asks for more of the scored rows: the teacher's top-K, the union,
        the actual token's log-prob, the tail mass, the log normalizer, a temperature; they come
        back as numpy arrays in the ``ScoreOutput`` (``candidates`` may then be None)."""
        return self._send(TeacherRequest(token_ids, candidates, start, cache_salt, request_id, prompt_logprobs,
                                         max_tokens, priority, targets, model))

    def score_batch(self, requests: Iterable[RequestLike], *, progress: bool = False,
                    return_exceptions: bool = False) -> list[np.ndarray | Exception]:
        """Score many requests, at most ``max_concurrency`` at once; results in input order.

        Each request is a ``TeacherRequest``, a dict of its fields, or a tuple in its field
        order. By default the first failure cancels the requests not yet started and is
        raised; with ``return_exceptions=True`` every request runs and a failed one's place in
        the list holds its exception. ``progress`` shows a tqdm bar when tqdm is installed,
        else a counter on stderr.
        """
        outs = self.score_batch_full(requests, progress=progress, return_exceptions=return_exceptions)
        return [o if isinstance(o, Exception) else o.scores for o in outs]

    def score_batch_full(self, requests: Iterable[RequestLike], *, progress: bool = False,
                         return_exceptions: bool = False) -> list[ScoreOutput | Exception]:
        """As ``score_batch``, returning ``ScoreOutput``s."""
        reqs = [as_request(r) for r in requests]
        bar = Progress(len(reqs), progress)
        # After a failure the batch is given up: requests not started are cancelled, those
        # being sent stop at their next retry (``stop``), and the failure is raised at once,
        # not after the threads have finished. The threads are daemons: one still waiting on
        # an answer nobody wants does not hold the interpreter's exit (an executor's would).
        stop = threading.Event()
        futures = self._run_batch(reqs, stop)
        for f in futures:
            f.add_done_callback(lambda f: f.cancelled() or bar.update())
        try:
            if return_exceptions:
                wait(futures)
                return [f.exception() or f.result() for f in futures]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception()), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            return [f.result() for f in futures]
        finally:
            stop.set()  # (a no-op once every request is done)
            for f in futures:
                f.cancel()  # those not started (the others run to their end)
            bar.close()

    def _run_batch(self, reqs: list[TeacherRequest], stop: threading.Event) -> list[Future]:
        """A future per request, run by up to ``max_concurrency`` daemon threads in order."""
        futures: list[Future] = [Future() for _ in reqs]
        order = iter(range(len(reqs)))
        lock = threading.Lock()

        def work() -> None:
            while not stop.is_set():
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                if not futures[i].set_running_or_notify_cancel():
                    continue
                try:
                    futures[i].set_result(self._send(reqs[i], stop))
                except BaseException as e:  # (the batch raises it)
                    futures[i].set_exception(e)

        for n in range(min(self.max_concurrency, len(reqs))):
            threading.Thread(target=work, name=f"teacher-client-{n}", daemon=True).start()
        return futures

    def score_batch_padded(self, requests: Iterable[RequestLike], *, length: int | None = None,
                           fill: float = 0.0, return_tensors: Literal["np", "pt"] = "np",
                           progress: bool = False) -> PaddedScores:
        """``score_batch`` as one ``[B, T, K]`` array and its ``[B, T]`` row mask (see
        ``pad_scores``); ``return_tensors="pt"`` gives torch tensors. Raises on the first failure."""
        results = self.score_batch(requests, progress=progress)
        # without return_exceptions every entry is a matrix
        return pad_scores(cast(list[np.ndarray], results), length=length, fill=fill, return_tensors=return_tensors)

    def _send(self, req: TeacherRequest, stop: threading.Event | None = None) -> ScoreOutput:
        """One request with its retries (``Attempts``); ``stop``: its batch was given up (no
        further attempt)."""
        stop = stop or threading.Event()
        content = self._encode(req)
        attempts = self._attempts(req)
        while True:
            if stop.is_set():
                raise TeacherServerError("not sent again: another request of its batch failed", type="cancelled",
                                         attempts=attempts.number)
            with attempts.sending() as url:
                path, headers, extensions = self._post_args(url)
                with self._slots:
                    attempts.resp = self._pool().post(path, content=content, headers=headers, extensions=extensions)
            out = attempts.outcome()
            if out is not None:
                return out
            wait = attempts.backoff()
            if wait is not None:
                stop.wait(wait)
