"""A request's way from its body to a priced plan, off the event loop wherever it is not constant
work: parse and check on the parser threads (large bodies), then a per-shape price on the pricing
thread within the request's deadline.

The pricing queue counts running work as well as waiting work: a price whose caller timed out or
left is still the thread's until it stops (within one slice, engine/pricing/ checks the request's
context between decoder calls), so it keeps its place in the count until then and later requests
are refused (429) instead of queueing behind work nobody waits for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from vae_service.engine import DecodeEngine, DecodeRequest, PreparedRequest
from vae_service.engine.request.context import RequestContext
from vae_service.engine.request.errors import DecodeTimeout, LimitExceeded, Overloaded

# Inputs above this size are parsed and checked off the event loop, where they cannot stall other
# requests. Measured here: a thread hop ~0.07 ms; parsing and checking a 64 KiB body inline
# ~0.07 ms, so up to 256 KiB the hop would cost as much as it saves.
INLINE_BYTES = 256 * 1024
PRICING_QUEUE = 8  # requests waiting for or holding the pricing thread before more are refused (429)


class RequestPricing:
    def __init__(self, engine: DecodeEngine, retry_after_s: float, fit_at_start: bool):
        self.engine, self.retry_after_s = engine, retry_after_s
        bind = engine.bind_thread
        # large bodies are parsed and checked here; prices that run the twin on their own thread
        self.parsers = ThreadPoolExecutor(2, thread_name_prefix="vae-parse", initializer=bind)
        self.pricing = ThreadPoolExecutor(1, thread_name_prefix="vae-price", initializer=bind)
        self._lock = threading.Lock()
        self.pricing_held = 0  # prices queued or running on the pricing thread, their callers gone or not
        # the class tiled decode's price is fitted here, beside start-up: the first request above the
        # bound then finds it made (else it waits for it on this thread, within its deadline)
        if fit_at_start:
            self.pricing.submit(engine.cost.fit_lazy_prices)

    async def prepare(
        self, parse: Callable[[], DecodeRequest], size: int, context: RequestContext, max_items: int
    ) -> PreparedRequest:
        """Parse and check (constant work beside the body's size), then price: inline where that is
        constant work, else on the pricing thread within the request's deadline."""
        engine = self.engine

        def check_and_price() -> tuple[PreparedRequest, bool]:
            """Checked, and priced too where that is constant work (else left for the pricing thread)."""
            checked = engine.check(parse(), context)
            if checked.items > max_items:  # no queue of this replica can ever hold it: refused unpriced
                raise LimitExceeded(
                    "latents",
                    f"{checked.items} items are more than this replica ever queues "
                    f"({max_items}, batching.max_queued_items): send fewer per request",
                )
            if engine.needs_shape_work(checked):
                return checked, False
            return engine.price(checked), True

        if size <= INLINE_BYTES:
            checked, priced = check_and_price()
        else:
            checked, priced = await off_loop(self.parsers, check_and_price, context, "parsing")
        if priced:
            return checked
        with self._lock:
            if self.pricing_held >= PRICING_QUEUE:
                raise Overloaded(
                    "latents",
                    f"{self.pricing_held} requests wait for a price or hold the pricing thread; retry later",
                    self.retry_after_s,
                )
            self.pricing_held += 1
        return await off_loop(self.pricing, engine.price, context, "pricing", checked, on_done=self._released)

    def _released(self, _future) -> None:
        """The pricing thread is done with a price: it ran, stopped, or was cancelled before it began."""
        with self._lock:
            self.pricing_held -= 1

    def shutdown(self) -> None:
        for pool in (self.parsers, self.pricing):
            pool.shutdown(wait=False)


async def off_loop(
    pool: ThreadPoolExecutor, work: Callable, context: RequestContext, what: str, *args, on_done: Callable | None = None
):
    """`work` on `pool` within the request's deadline; `on_done` once the pool is done with it. A
    caller that stops waiting (deadline, or cancelled) abandons the context, which the work checks
    between its steps: it stops too (work not yet begun is cancelled)."""
    future = pool.submit(work, *args)
    if on_done is not None:
        future.add_done_callback(on_done)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), context.remaining())
    except TimeoutError:
        raise DecodeTimeout("body", f"not decoded within request_timeout_s (timed out {what})") from None
    except asyncio.CancelledError:
        if not context.expired:
            context.abandon()
        raise
