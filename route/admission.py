"""Bounded admission: at most ``max_inflight`` requests dispatched, ``max_queue`` waiting.

A request that finds the queue full is refused at once (429); one that waits past its
deadline, or while no server can take it, is refused then (503). Both carry
``Retry-After``. Nothing waits without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from .errors import RouteError
from .metrics import RouteMetrics

__all__ = ["Admission"]


class Admission:
    """The router's request slots."""

    def __init__(self, max_inflight: int, max_queue: int, retry_after_s: float, metrics: RouteMetrics | None = None):
        self.max_inflight, self.max_queue, self.retry_after_s = max_inflight, max_queue, retry_after_s
        self._sem = asyncio.Semaphore(max_inflight)
        self.inflight = 0
        self.waiting = 0
        self._m = metrics

    def _gauges(self) -> None:
        if self._m is not None:
            self._m.inflight.set(self.inflight)
            self._m.queued.set(self.waiting)

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold one dispatch slot while the block runs; wait at most ``timeout_s`` for it."""
        if self._sem.locked() and self.waiting >= self.max_queue:
            raise RouteError(429, "saturated", f"the router is saturated: {self.inflight} requests in flight and "
                             f"{self.waiting} waiting (max_queue {self.max_queue})", self.retry_after_s)
        self.waiting += 1
        self._gauges()
        try:
            await asyncio.wait_for(self._sem.acquire(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            raise RouteError(503, "saturated", f"no dispatch slot within {timeout_s:.2f} s (the request's deadline)",
                             self.retry_after_s) from None
        finally:
            self.waiting -= 1
            self._gauges()
        self.inflight += 1
        self._gauges()
        try:
            yield
        finally:
            self.inflight -= 1
            self._sem.release()
            self._gauges()
