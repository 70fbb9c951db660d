"""Retry policy shared by every client: only overload (429/503) is retried, with exponential
backoff that never undercuts the server's Retry-After."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from vae_service_client.errors import Overloaded, VaeServiceError

T = TypeVar("T")


def retry_delay(attempt: int, error: VaeServiceError, backoff_s: float, max_backoff_s: float = 8.0) -> float:
    return max(min(backoff_s * 2**attempt, max_backoff_s), error.retry_after or 0.0)


def with_retries(call: Callable[[], T], retries: int, backoff_s: float) -> T:
    """`call()` again while it raises Overloaded, up to `retries` more times."""
    for attempt in range(retries):
        try:
            return call()
        except Overloaded as exc:
            time.sleep(retry_delay(attempt, exc, backoff_s))
    return call()


async def with_retries_async(call: Callable[[], Awaitable[T]], retries: int, backoff_s: float) -> T:
    for attempt in range(retries):
        try:
            return await call()
        except Overloaded as exc:
            await asyncio.sleep(retry_delay(attempt, exc, backoff_s))
    return await call()
