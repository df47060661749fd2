"""HTTP client for RL trainers: score student candidates against a running teacher-server.

``TeacherClient`` (sync, threads) and ``AsyncTeacherClient`` (asyncio) share one surface:
``score`` returns the ``[rows, K]`` float32 matrix, ``score_full`` a ``ScoreOutput`` with the
matrix and the response metadata, ``score_batch`` many requests with bounded concurrency in
input order. Candidates always travel as a base64 ``.npy`` int32 array (JSON lists of
8k x 256 ids are megabytes). 429 and 503 (honouring ``Retry-After``), connection errors and
timeouts are retried with exponential backoff and jitter; other errors raise
``TeacherServerError`` at once.

Only numpy and httpx are needed: this module never imports torch.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import numpy as np

from teacher_server import __version__

__all__ = ["TeacherClient", "AsyncTeacherClient", "TeacherRequest", "ScoreOutput", "TeacherServerError",
           "RETRY_STATUSES"]

GENERATE_PATH = "/inference/v1/generate"
RETRY_STATUSES = frozenset({429, 503})  # overloaded / draining: the server says when to come back
# Failures where the request may not have reached the engine, or its answer was lost;
# scoring is idempotent, so sending it again is safe.
_RETRY_EXCEPTIONS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_INT32 = np.iinfo(np.int32)


class TeacherServerError(Exception):
    """A request that failed for good.

    ``status`` is the HTTP status (None when no response came back, e.g. connection refused
    after every retry); ``type``, ``message``, ``param`` and ``code`` come from the server's
    ``{"error": {...}}`` body; ``attempts`` counts the requests sent.
    """

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: int | None = None, attempts: int = 1) -> None:
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.attempts = attempts
        where = f" (param: {param})" if param else ""
        head = f"{status} {type or 'error'}" if status is not None else (type or "error")
        super().__init__(f"{head}: {message}{where} [after {attempts} attempt(s)]")


@dataclass(frozen=True)
class TeacherRequest:
    """One scoring request for ``score_batch``; the fields are ``score``'s arguments.

    ``score_batch`` also takes plain dicts with these keys, or tuples in this order.
    """

    token_ids: Sequence[int] | np.ndarray
    candidates: Sequence[int] | Sequence[Sequence[int]] | np.ndarray
    start: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 0
    priority: int = 0


@dataclass(frozen=True)
class ScoreOutput:
    """A scored request: the matrix plus what the server reported about it."""

    scores: np.ndarray  # [rows, K] float32 teacher log-probs (logits in raw_logits mode)
    request_id: str
    model: str
    next_token: int | None  # greedy next token when max_tokens=1
    prompt_tokens: int
    cached_tokens: int  # tokens whose KV came from the prefix cache
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None  # vLLM's classic layout, when asked


# --- request / response encoding (shared by both clients) ------------------------------------

def encode_candidates(candidates: Any) -> str:
    """Candidates ([K] shared or [rows, K] per row, -1 pads) -> base64 ``.npy`` int32."""
    arr = np.asarray(candidates)
    if arr.ndim not in (1, 2):
        raise ValueError(f"candidates must have shape [K] or [rows, K], got {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"candidates must be integer ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError("candidate ids must fit in int32")
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr, dtype="<i4"), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def build_body(req: TeacherRequest, model: str | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /inference/v1/generate`` for one request."""
    toks = np.asarray(req.token_ids)
    if toks.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ids, got shape {list(toks.shape)}")
    if toks.size and toks.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integer ids, got dtype {toks.dtype}")
    sp: dict[str, Any] = {"prompt_logprob_token_ids": encode_candidates(req.candidates),
                          "prompt_logprob_start": int(req.start), "max_tokens": int(req.max_tokens)}
    if req.prompt_logprobs is not None:
        sp["prompt_logprobs"] = int(req.prompt_logprobs)
    body: dict[str, Any] = {"token_ids": toks.astype(np.int64).tolist(), "sampling_params": sp}
    if req.priority:
        body["priority"] = int(req.priority)
    for key, value in (("request_id", req.request_id), ("cache_salt", req.cache_salt), ("model", model)):
        if value is not None:
            body[key] = value
    return body


def parse_output(data: Mapping[str, Any]) -> ScoreOutput:
    """A 200 response body -> ``ScoreOutput`` (the matrix decoded without unpickling)."""
    raw = data.get("prompt_token_id_logprobs")
    if raw is None:
        raise TeacherServerError("response has no prompt_token_id_logprobs", status=200)
    scores = np.load(io.BytesIO(base64.b64decode(raw)), allow_pickle=False).astype(np.float32, copy=False)
    toks = (data.get("choices") or [{}])[0].get("token_ids") or []
    usage = data.get("usage") or {}
    return ScoreOutput(scores=scores, request_id=data.get("request_id", ""), model=data.get("model", ""),
                       next_token=int(toks[0]) if toks else None,
                       prompt_tokens=int(usage.get("prompt_tokens", 0)),
                       cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                       prompt_logprobs=data.get("prompt_logprobs"))


def error_from_response(resp: httpx.Response, attempts: int) -> TeacherServerError:
    """A non-200 response -> ``TeacherServerError`` from vLLM's error shape (or the raw text)."""
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):  # not our error shape: a proxy page, an empty body, ...
        return TeacherServerError(resp.text[:300] or resp.reason_phrase, status=resp.status_code, attempts=attempts)
    code = err.get("code")
    return TeacherServerError(str(err.get("message", "")), status=resp.status_code, type=err.get("type"),
                              param=err.get("param"), code=code if isinstance(code, int) else None,
                              attempts=attempts)


def _as_request(item: TeacherRequest | Mapping[str, Any] | Sequence[Any]) -> TeacherRequest:
    if isinstance(item, TeacherRequest):
        return item
    if isinstance(item, Mapping):
        return TeacherRequest(**item)
    return TeacherRequest(*item)


# --- retries -------------------------------------------------------------------------------

def retry_after_seconds(resp: httpx.Response) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


class _Retry:
    """Decides whether to try again and how long to wait first."""

    def __init__(self, max_retries: int, backoff: float, max_backoff: float) -> None:
        assert max_retries >= 0 and backoff >= 0 and max_backoff >= 0, (max_retries, backoff, max_backoff)
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._rng = random.Random()

    def delay(self, attempt: int, resp: httpx.Response | None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if resp is not None:
            hinted = retry_after_seconds(resp)
            if hinted is not None:
                return min(hinted, self.max_backoff)
        # Exponential backoff with "equal jitter": half fixed, half random, so clients that
        # failed together do not come back together.
        d = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
        return d / 2 + self._rng.uniform(0, d / 2)


def _timeout(timeout: float | httpx.Timeout) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(timeout, 10.0))  # fail over fast when nobody listens


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"user-agent": f"teacher-server-client/{__version__}"}
    if api_key is not None:
        h["authorization"] = f"Bearer {api_key}"
    return h


class _Progress:
    """tqdm when it is installed, else a plain counter on stderr; nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self._bar, self._last = total, 0, None, 0.0
        self.enabled = enabled
        self._lock = threading.Lock()  # updated from worker threads
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc="scoring", unit="req")

    def update(self) -> None:
        with self._lock:
            self.done += 1
            if not self.enabled:
                return
            if self._bar is not None:
                self._bar.update(1)
                return
            now = time.monotonic()
            if self.done == self.total or now - self._last > 0.5:
                self._last = now
                sys.stderr.write(f"\rscoring: {self.done}/{self.total}")
                sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.total:
            sys.stderr.write("\n")


# --- clients -------------------------------------------------------------------------------

class _Base:
    def __init__(self, base_url: str, api_key: str | None, timeout: float | httpx.Timeout, max_retries: int,
                 backoff: float, max_backoff: float, max_concurrency: int, model: str | None) -> None:
        assert max_concurrency >= 1, f"max_concurrency must be >= 1, got {max_concurrency}"
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self._retry = _Retry(max_retries, backoff, max_backoff)
        self._limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client_kw = dict(base_url=self.base_url, headers=_headers(api_key), timeout=_timeout(timeout),
                               limits=self._limits)

    def _encode(self, req: TeacherRequest) -> bytes:
        return json.dumps(build_body(req, self.model), separators=(",", ":")).encode()

    def _outcome(self, attempt: int, resp: httpx.Response | None, err: Exception | None) -> ScoreOutput | None:
        """One attempt's outcome: the parsed output on 200; raises when the failure is not to
        be retried (or retries are used up); None to retry."""
        if resp is not None and resp.status_code == 200:
            return parse_output(resp.json())
        if not self._retryable(attempt, resp):
            if resp is None:
                raise TeacherServerError(f"{type(err).__name__}: {err}", type=type(err).__name__,
                                         attempts=attempt) from err
            raise error_from_response(resp, attempt)
        return None

    def _retryable(self, attempt: int, resp: httpx.Response | None) -> bool:
        return attempt <= self._retry.max_retries and (resp is None or resp.status_code in RETRY_STATUSES)


class TeacherClient(_Base):
    """Synchronous client (thread-safe; ``score_batch`` runs requests on a thread pool).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        timeout: seconds per attempt (connect capped at 10 s), or an ``httpx.Timeout``.
        max_retries: retries after the first attempt on 429/503, connection errors and timeouts.
        backoff: first backoff in seconds; doubles per retry, with jitter, up to ``max_backoff``.
            A ``Retry-After`` header replaces the computed wait.
        max_concurrency: requests in flight at once (threads of ``score_batch``, pooled connections).
        model: sent as ``model``; the server answers 404 when it serves another one.
        transport: a custom ``httpx.BaseTransport`` (TLS settings, proxies, tests).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | httpx.Timeout = 600.0,
                 max_retries: int = 5, backoff: float = 0.5, max_concurrency: int = 16, *,
                 max_backoff: float = 30.0, model: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, backoff, max_backoff, max_concurrency, model)
        self._http = httpx.Client(transport=transport, **self._client_kw)
        self._slots = threading.BoundedSemaphore(max_concurrency)

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def score(self, token_ids: Sequence[int] | np.ndarray,
              candidates: Sequence[int] | Sequence[Sequence[int]] | np.ndarray, start: int = 0, *,
              cache_salt: str | None = None, request_id: str | None = None, prompt_logprobs: int | None = None,
              max_tokens: int = 0, priority: int = 0) -> np.ndarray:
        """Teacher log-probs of ``candidates``: a ``[rows, K]`` float32 matrix,
        ``rows = max(len(token_ids) - 1 - start, 0)``; row i scores token ``start + i + 1``.

        ``candidates`` is ``[K]`` (shared by every row) or ``[rows, K]`` (one row per scored
        position, ``-1`` pads and scores ``-inf``). Raises ``TeacherServerError``.
        """
        return self.score_full(token_ids, candidates, start, cache_salt=cache_salt, request_id=request_id,
                               prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, priority=priority).scores

    def score_full(self, token_ids: Sequence[int] | np.ndarray,
                   candidates: Sequence[int] | Sequence[Sequence[int]] | np.ndarray, start: int = 0, *,
                   cache_salt: str | None = None, request_id: str | None = None,
                   prompt_logprobs: int | None = None, max_tokens: int = 0, priority: int = 0) -> ScoreOutput:
        """As ``score``, returning a ``ScoreOutput`` (matrix, next token, usage, prompt_logprobs, request id)."""
        return self._send(TeacherRequest(token_ids, candidates, start, cache_salt, request_id, prompt_logprobs,
                                         max_tokens, priority))

    def score_batch(self, requests: Iterable[TeacherRequest | Mapping[str, Any] | Sequence[Any]], *,
                    progress: bool = False) -> list[np.ndarray]:
        """Score many requests, at most ``max_concurrency`` at once; results in input order.

        Each request is a ``TeacherRequest``, a dict of its fields, or a tuple in its field
        order. The first failure cancels the requests not yet started and is raised.
        ``progress`` shows a tqdm bar when tqdm is installed, else a counter on stderr.
        """
        return [o.scores for o in self.score_batch_full(requests, progress=progress)]

    def score_batch_full(self, requests: Iterable[TeacherRequest | Mapping[str, Any] | Sequence[Any]], *,
                         progress: bool = False) -> list[ScoreOutput]:
        """As ``score_batch``, returning ``ScoreOutput``s."""
        reqs = [_as_request(r) for r in requests]
        bar = _Progress(len(reqs), progress)
        try:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(reqs), 1)),
                                    thread_name_prefix="teacher-client") as pool:
                futures = [pool.submit(self._send, r) for r in reqs]
                for f in futures:
                    f.add_done_callback(lambda f: f.cancelled() or bar.update())
                _, pending = wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception()), None)
                if failed is not None:
                    for f in pending:
                        f.cancel()
                    raise failed.exception()  # type: ignore[misc]
                return [f.result() for f in futures]
        finally:
            bar.close()

    def _send(self, req: TeacherRequest) -> ScoreOutput:
        content = self._encode(req)
        attempt = 0
        while True:
            attempt += 1
            resp = err = None
            try:
                with self._slots:
                    resp = self._http.post(GENERATE_PATH, content=content,
                                           headers={"content-type": "application/json"})
            except _RETRY_EXCEPTIONS as e:
                err = e
            out = self._outcome(attempt, resp, err)
            if out is not None:
                return out
            time.sleep(self._retry.delay(attempt, resp))


class AsyncTeacherClient(_Base):
    """Asyncio client with ``TeacherClient``'s surface (``await client.score(...)``).

    At most ``max_concurrency`` requests are in flight at once across all callers
    (an ``asyncio.Semaphore``). ``transport`` takes an ``httpx.AsyncBaseTransport``.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | httpx.Timeout = 600.0,
                 max_retries: int = 5, backoff: float = 0.5, max_concurrency: int = 16, *,
                 max_backoff: float = 30.0, model: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, timeout, max_retries, backoff, max_backoff, max_concurrency, model)
        self._http = httpx.AsyncClient(transport=transport, **self._client_kw)
        self._slots = asyncio.Semaphore(max_concurrency)

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def score(self, token_ids: Sequence[int] | np.ndarray,
                    candidates: Sequence[int] | Sequence[Sequence[int]] | np.ndarray, start: int = 0, *,
                    cache_salt: str | None = None, request_id: str | None = None,
                    prompt_logprobs: int | None = None, max_tokens: int = 0, priority: int = 0) -> np.ndarray:
        """See ``TeacherClient.score``."""
        out = await self.score_full(token_ids, candidates, start, cache_salt=cache_salt, request_id=request_id,
                                    prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, priority=priority)
        return out.scores

    async def score_full(self, token_ids: Sequence[int] | np.ndarray,
                         candidates: Sequence[int] | Sequence[Sequence[int]] | np.ndarray, start: int = 0, *,
                         cache_salt: str | None = None, request_id: str | None = None,
                         prompt_logprobs: int | None = None, max_tokens: int = 0,
                         priority: int = 0) -> ScoreOutput:
        """See ``TeacherClient.score_full``."""
        return await self._send(TeacherRequest(token_ids, candidates, start, cache_salt, request_id,
                                               prompt_logprobs, max_tokens, priority))

    async def score_batch(self, requests: Iterable[TeacherRequest | Mapping[str, Any] | Sequence[Any]], *,
                          progress: bool = False) -> list[np.ndarray]:
        """See ``TeacherClient.score_batch``."""
        return [o.scores for o in await self.score_batch_full(requests, progress=progress)]

    async def score_batch_full(self, requests: Iterable[TeacherRequest | Mapping[str, Any] | Sequence[Any]], *,
                               progress: bool = False) -> list[ScoreOutput]:
        """See ``TeacherClient.score_batch_full``."""
        reqs = [_as_request(r) for r in requests]
        bar = _Progress(len(reqs), progress)
        tasks = [asyncio.ensure_future(self._send(r)) for r in reqs]
        for t in tasks:
            t.add_done_callback(lambda t: t.cancelled() or bar.update())
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # after a failure: do not leave the others running
                t.cancel()
            bar.close()

    async def _send(self, req: TeacherRequest) -> ScoreOutput:
        content = self._encode(req)
        attempt = 0
        while True:
            attempt += 1
            resp = err = None
            try:
                async with self._slots:
                    resp = await self._http.post(GENERATE_PATH, content=content,
                                                 headers={"content-type": "application/json"})
            except _RETRY_EXCEPTIONS as e:
                err = e
            out = self._outcome(attempt, resp, err)
            if out is not None:
                return out
            await asyncio.sleep(self._retry.delay(attempt, resp))
