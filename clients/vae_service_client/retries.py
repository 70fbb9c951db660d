"""The retry policy of every client (HTTP and gRPC, sync and async), written once here.

Retried, up to `retries` more times, backoff doubling from `backoff_s` (at most 8 s) and never
sooner than the server's Retry-After: Overloaded, that is 429/503 answers and Unavailable (a 503
`unavailable`, or the connection closed before the answer was complete: the replica went away,
another one answers; decoding is a pure function, so sending it again is safe).

Not retried: ServiceUnreachable (nothing listens there: a wrong address or a stopped service, which
seconds of backoff do not fix, so the caller hears it at once), DecodeTimeout (a decode that outlasted
the timeout would take as long again: raise `timeout` instead), and every other error (the request
itself is at fault).

Callers retry only while nothing reached their caller: a streamed answer until it opened, never
after frames were handed out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from vae_service_client.errors import Overloaded, VaeServiceError

T = TypeVar("T")


def retry_delay(attempt: int, error: VaeServiceError, backoff_s: float, max_backoff_s: float = 8.0) -> float:
    return max(min(backoff_s * 2**attempt, max_backoff_s), error.retry_after or 0.0)


def next_delay(
    attempt: int, error: VaeServiceError, retries: int, backoff_s: float, retried: tuple[type, ...] = (Overloaded,)
) -> float | None:
    """Seconds to wait before trying again after attempt `attempt` (from 0) failed with `error`;
    None: give up and raise it. `retried`: what is retried (an attach also retries SessionMoved: it
    reached the replica the session is leaving, before Serve stopped routing to it)."""
    if attempt >= retries or not isinstance(error, retried):
        return None
    return retry_delay(attempt, error, backoff_s)


def with_retries(call: Callable[[], T], retries: int, backoff_s: float, retried: tuple[type, ...] = (Overloaded,)) -> T:
    """`call()` again while the policy retries what it raises."""
    attempt = 0
    while True:
        try:
            return call()
        except VaeServiceError as exc:
            if (delay := next_delay(attempt, exc, retries, backoff_s, retried)) is None:
                raise
            time.sleep(delay)
        attempt += 1


async def with_retries_async(
    call: Callable[[], Awaitable[T]], retries: int, backoff_s: float, retried: tuple[type, ...] = (Overloaded,)
) -> T:
    attempt = 0
    while True:
        try:
            return await call()
        except VaeServiceError as exc:
            if (delay := next_delay(attempt, exc, retries, backoff_s, retried)) is None:
                raise
            await asyncio.sleep(delay)
        attempt += 1
