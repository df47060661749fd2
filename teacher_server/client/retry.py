"""When a failed attempt is sent again, and how long the client waits first.

Retried: 429 and 503 (the server is overloaded or draining and says when to come back with
``Retry-After``), 502 and 504 (an ingress or load balancer in front of the server lost the
upstream or timed out), and connection errors and timeouts. Scoring is idempotent, so sending
a request again is always safe. Every other status fails at once, and so does a 200 whose
body is not a scoring answer (a proxy's page, a truncated body): ``TeacherServerError`` either way.

The wait before a retry grows exponentially (with jitter); a ``Retry-After`` from the server is
the least it waits, so a server that keeps saying "1 s" under a long overload is not asked again
every second until the retries run out. With several servers, an attempt that finds its server
not there takes that server out and goes to another one at once, without the wait.

``RetryPolicy`` decides each attempt's outcome and wait; ``Attempts`` is one request's run of
attempts, which both clients drive alike: the sync one waits on a thread, the async one with
``asyncio.sleep``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime

import httpx

from teacher_server.client.endpoints import DOWN_STATUSES, Endpoints
from teacher_server.client.protocol import ScoreOutput, TeacherServerError, loads, parse_output

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Failures where the request may not have reached the engine, or its answer was lost.
RETRY_EXCEPTIONS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
# Failures that say the server is not there (as opposed to slow: a read timeout is not one).
DOWN_EXCEPTIONS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                   httpx.WriteError)


def retry_after_seconds(resp: httpx.Response) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if not math.isnan(seconds) else None
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def unretried(err: httpx.HTTPError, attempts: int) -> TeacherServerError:
    """An httpx failure that is not retried (an answer that cannot be decoded, too many
    redirects, ...) as the ``TeacherServerError`` every failure is."""
    resp = getattr(err, "response", None)  # (HTTPStatusError only)
    return TeacherServerError(f"{type(err).__name__}: {str(err)[:300]}", type=type(err).__name__,
                              status=resp.status_code if resp is not None else None, attempts=attempts)


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


class RetryPolicy:
    """One outcome rule per attempt, shared by the sync and async clients."""

    def __init__(self, max_retries: int, backoff: float, max_backoff: float) -> None:
        if not (max_retries >= 0 and backoff >= 0 and max_backoff >= 0):
            raise ValueError(f"max_retries, backoff and max_backoff must be >= 0, got {max_retries}, {backoff}, "
                             f"{max_backoff}")
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._rng = random.Random()

    def outcome(self, attempt: int, resp: httpx.Response | None, err: Exception | None,
                expect_scores: bool = True) -> ScoreOutput | None:
        """Attempt number ``attempt`` (1-based) gave ``resp`` or failed with ``err``: the parsed
        output on 200 (``expect_scores``: the request sent candidates); None to try again;
        raises when the failure is final."""
        if resp is not None and resp.status_code == 200:
            try:
                return parse_output(loads(resp.content), expect_scores)
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # not our answer (a proxy's page, ...)
                raise TeacherServerError(f"unreadable answer: {type(e).__name__}: {str(e)[:200]}", status=200,
                                         type="invalid_response", attempts=attempt) from e
        retryable = resp is None or resp.status_code in RETRY_STATUSES
        if retryable and attempt <= self.max_retries:
            return None
        if resp is None:
            raise TeacherServerError(f"{type(err).__name__}: {err}", type=type(err).__name__,
                                     attempts=attempt) from err
        raise error_from_response(resp, attempt)

    def delay(self, attempt: int, resp: httpx.Response | None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based): exponential backoff
        with "equal jitter" (half fixed, half random, so clients that failed together do not
        come back together), at least the server's ``Retry-After`` (itself spread by up to a
        fifth), at most ``max_backoff``."""
        d = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
        wait = d / 2 + self._rng.uniform(0, d / 2)
        hinted = retry_after_seconds(resp) if resp is not None else None
        if hinted is not None:
            wait = max(wait, hinted * self._rng.uniform(1.0, 1.2))
        return min(wait, self.max_backoff)


class Attempts:
    """The attempts of one request, and what follows each: the loop both clients run, which
    differ only in how they send and wait::

        attempts = Attempts(policy, endpoints, key, tokens)
        while True:
            with attempts.sending() as url:  # the server this attempt goes to (None: the one base URL)
                attempts.resp = post(url)
            out = attempts.outcome()  # the answer; None to try again; raises when the failure is final
            if out is not None:
                return out
            wait = attempts.backoff()  # None: another server takes it at once
            if wait is not None:
                sleep(wait)
    """

    def __init__(self, policy: RetryPolicy, endpoints: Endpoints | None, key: bytes | None, tokens: int,
                 expect_scores: bool = True) -> None:
        self.policy = policy
        self.expect_scores = expect_scores  # the request sent candidates: an answer must hold their scores
        self.endpoints = endpoints
        self.key = key  # the request's routing key (None with one server)
        self.tokens = tokens  # counted in flight on the server an attempt goes to
        self.number = 0  # attempts begun
        self.url: str | None = None  # the current attempt's server (None: the one base URL)
        self.resp: httpx.Response | None = None  # the current attempt's answer, set by the caller
        self.err: Exception | None = None  # or its retried failure
        self._elsewhere = False  # the attempt's server was taken out and another one is up

    @contextmanager
    def sending(self) -> Iterator[str | None]:
        """One attempt, around the caller's post: picks its server (after a failure, another
        one when any is up) and counts the request in flight there. A failure that is retried
        (connection errors, timeouts) is kept for ``outcome``; another httpx failure is raised as
        ``TeacherServerError``; anything else (the request's own encoding error, a cancellation)
        goes through."""
        self.number += 1
        self.resp = self.err = None
        ep = self.endpoints
        self.url = None if ep is None else ep.pick(self.key, avoid=self.url)
        if self.url is not None:
            ep.begin(self.url, self.tokens)
        try:
            yield self.url
        except RETRY_EXCEPTIONS as e:
            self.err = e
        except httpx.HTTPError as e:  # not retried (a body that cannot be decoded, ...)
            raise unretried(e, self.number) from e
        finally:
            if self.url is not None:
                ep.end(self.url, self.tokens)

    def outcome(self) -> ScoreOutput | None:
        """After an attempt: the parsed answer on 200; None to try again (after ``backoff``);
        raises ``TeacherServerError`` when the failure is final. A server that is not there is
        taken out first."""
        self._elsewhere = self._fail_over()
        return self.policy.outcome(self.number, self.resp, self.err, self.expect_scores)

    def backoff(self) -> float | None:
        """Seconds to wait before the next attempt; None when another server is up to take it
        now (the backoff is for a server that is there but busy)."""
        return None if self._elsewhere else self.policy.delay(self.number, self.resp)

    def _fail_over(self) -> bool:
        """Take the attempt's server out when it is not there, and say whether to go to
        another one at once (True) rather than after the backoff."""
        if self.url is None or self.endpoints is None:
            return False
        if isinstance(self.err, DOWN_EXCEPTIONS):
            return self.endpoints.mark_down(self.url, f"{type(self.err).__name__}: {self.err}")
        if self.resp is not None and self.resp.status_code in DOWN_STATUSES:
            return self.endpoints.mark_down(self.url, f"HTTP {self.resp.status_code}")
        return False
