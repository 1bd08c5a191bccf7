"""Sender calls handed over in order, each after the device work it reads has finished.

A layer-wise prefill hands layer ``i`` to the sender from inside the forward. On CPU the
layer's K and V are in the pool when the hook runs, so the call runs at once on the
caller's thread. On CUDA they are not until the forward stream reaches the point where
the hook ran: the caller records an event there and ``OrderedCalls`` runs the call on its
own thread once the event completed, so the forward stream never waits on the network
and the forward's thread never waits on the device. Once one call has gone to the thread,
every later call goes there too (a room's ``finish`` must not overtake its queued layers).
Used by both engine plugins.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

__all__ = ["OrderedCalls", "stream_event"]

log = logging.getLogger(__name__)


def stream_event(stream: Any = None) -> Any:
    """A ``torch.cuda.Event`` recorded now on ``stream`` (the current CUDA stream when None):
    what a plugin hands ``OrderedCalls.call`` with a call that reads the forward's output."""
    import torch

    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev


class OrderedCalls:
    """Calls run in the order given: at once while none is queued and a call brings no
    event; otherwise on one thread of this object's, each after ``event.synchronize()``
    (a ``torch.cuda.Event``, or a tuple of them) returned."""

    def __init__(self, name: str = "kvbridge-layers"):
        self.name = name
        self._q: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], None], event: Any = None) -> None:
        """Run ``fn`` now (no event, nothing queued) or queue it after ``event``."""
        with self._lock:
            if event is None and self._q is None:
                run_now = True
            else:
                run_now = False
                if self._q is None:
                    self._q = queue.Queue()
                    self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                    self._thread.start()
                self._q.put((fn, event))
        if run_now:
            fn()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, event = item
            try:
                for ev in event if isinstance(event, tuple) else (event,):
                    if ev is not None:
                        ev.synchronize()  # this thread waits, never the forward stream
                fn()
            except Exception:  # each call fails its own room; nothing may stop the others
                log.exception("kvbridge: a queued %s call failed", self.name)

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued, then stop the thread (waits up to ``timeout_s``)."""
        with self._lock:
            q, t = self._q, self._thread
        if q is not None:
            q.put(None)
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s)
