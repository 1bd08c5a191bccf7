"""Waking a TensorRT-LLM executor that waits for requests while blocks wait for it.

TensorRT-LLM 1.2's executor frees a handed-off request's blocks only from
``get_finished``, which it calls once per loop iteration. With block reuse on, a finished
request whose KV is still being sent leaves ``active_requests`` (``_handle_responses``),
and an executor with nothing active waits for its next request with no timeout
(``_fetch_and_process_requests``: ``timeout=None`` when idle). So on a server whose last
request was a prefill half, the blocks every rank has let go of stay pinned until some
other request arrives. A request the client cancelled while its KV loaded, whose free
the plugin holds until the load is quiet (``worker._hold_engine_frees``), waits the
same way.

``IdleWake`` lives on rank 0 (in the scheduler). It learns when every rank let go of a
request's blocks (``ready``, from the workers' ``Released`` messages) and when the
executor calls ``get_finished`` (``polled``, from rank 0's worker). A request is taken
once enough iterations have run after it was ready (one on one rank; two with more, as a
rank's ``get_finished`` of the first may precede its release). If none runs within
``WAKE_AFTER_S``, it wakes the executor through its own request queue: a cancel of that
request id (``PyExecutor.cancel_request``), which ends the wait and matches no active
request. The id stays in the executor's ``canceled_req_ids`` (TensorRT-LLM removes only
ids that cancelled a request), so each rank's worker removes it again in
``get_finished`` (``forget_wake_ids``).

Main's executor keeps polling while a transfer is pending, so no wake is armed there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["IdleWake", "WAKE_AFTER_S", "canceled_ids", "forget_wake_ids"]

WAKE_AFTER_S = 0.1  # no executor iteration for this long after blocks are ready: wake it
_KEEP = 4096  # requests tracked at most (the oldest dropped; a rank that never reports)


class IdleWake:
    """Rank 0: wake the executor when released blocks wait for an iteration that does not come."""

    def __init__(self, world_size: int, after_s: float = WAKE_AFTER_S):
        self.world_size = max(1, int(world_size))
        self.after_s = float(after_s)
        self._lock = threading.Lock()
        self._wake: Callable[[int], None] | None = None
        self._released: OrderedDict[int, set[int]] = OrderedDict()  # request id -> ranks that let go
        self._ready: OrderedDict[int, list] = OrderedDict()  # request id -> [polls when ready, last nudge]
        self._polls = 0
        self._last_poll = time.monotonic()
        self.wakes = 0  # wakes issued (each one cancel of a finished request id)

    def attach(self, wake: Callable[[int], None]) -> None:
        """Rank 0's worker: ``wake(request_id)`` ends the executor's wait for requests."""
        with self._lock:
            self._wake = wake

    def released(self, req: int, rank: int) -> None:
        """Bus thread: ``rank`` let go of request ``req``'s blocks."""
        with self._lock:
            ranks = self._released.setdefault(int(req), set())
            ranks.add(int(rank))
            if len(ranks) < self.world_size:
                while len(self._released) > _KEEP:
                    self._released.popitem(last=False)
                return
            del self._released[int(req)]
            self._ready[int(req)] = [self._polls, time.monotonic()]
            while len(self._ready) > _KEEP:
                self._ready.popitem(last=False)

    def polled(self) -> None:
        """Executor thread (rank 0's ``get_finished``): an iteration ran."""
        need = 1 if self.world_size == 1 else 2
        with self._lock:
            self._polls += 1
            self._last_poll = time.monotonic()
            for req in [r for r, (p, _) in self._ready.items() if self._polls - p >= need]:
                del self._ready[req]

    def tick(self, now: float | None = None) -> None:
        """Bus thread (periodic): wake the executor for requests ready with no iteration since."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._wake is None or not self._ready:
                return
            due = [r for r, e in self._ready.items() if now - max(e[1], self._last_poll) >= self.after_s]
            if not due:
                return
            req = due[0]  # one wake runs an iteration for every ready request
            for r in due:
                self._ready[r][1] = now
            wake = self._wake
            self.wakes += 1
        log.debug("kvbridge: waking the idle executor for request %s's blocks", req)
        try:
            wake(req)
        except Exception:
            log.exception("kvbridge: could not wake the executor for request %s", req)


def canceled_ids(executor: Any) -> list | None:
    """The executor's list of cancelled request ids (1.2: on its ``executor_request_queue``;
    earlier 1.x: on the executor), or None."""
    q = getattr(executor, "executor_request_queue", None)
    ids = getattr(q if q is not None else executor, "canceled_req_ids", None)
    return ids if isinstance(ids, list) else None


def forget_wake_ids(executor: Any, let_go: Callable[[int], bool]) -> None:
    """Executor thread: remove from the executor's cancelled ids those for which
    ``let_go(id)`` (a request whose blocks this rank let go of) that cancel no active
    request. Nothing to do, and ``let_go`` not asked, while the list is empty."""
    ids = canceled_ids(executor)
    if not ids:
        return
    stale = [i for i in ids if let_go(i)]
    if not stale:
        return
    active = {getattr(r, "py_request_id", getattr(r, "request_id", None)) for r in getattr(executor, "active_requests", ())}
    for i in stale:
        if i not in active:
            ids.remove(i)
