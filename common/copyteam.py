"""A work-sharing team for CPU copies: the calling thread and a few helper threads take
the pieces of one copy from a shared counter, and the caller returns once every piece is
done. Unlike torch's OpenMP pool, the caller never waits for a thread that has not
started: a helper that wakes late finds the pieces taken and goes back to sleep, so a
host whose cores are busy with other work costs at most one piece in progress, not a
scheduler quantum per parallel region (measured on a 2-core host under load 15: 128 parts
of 4 MiB through torch's pool ran at 0.08-0.12 of a memcpy; see docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

__all__ = ["CopyTeam", "default_helpers"]


def default_helpers() -> int:
    """Helper threads for a copy team: the CPUs this process may use, less the caller's, at most 3."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(0, min(3, cpus - 1))


class _Job:
    def __init__(self, pieces: list[Callable[[], object]]):
        self.pieces = pieces
        self.next = itertools.count()  # next() is atomic under the GIL: each piece is taken once
        self.left = len(pieces)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        n = len(self.pieces)
        while True:
            i = next(self.next)
            if i >= n:
                return
            try:
                self.pieces[i]()
            except BaseException as e:  # handed to the caller
                self.error = self.error or e
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class CopyTeam:
    """``team(pieces)`` runs every thunk of ``pieces`` (on the calling thread and ``helpers``
    daemon threads) and returns once all are done; a piece's exception is raised in the
    caller. Thread-safe: several callers may run jobs at once. ``close()`` stops the helpers."""

    def __init__(self, helpers: int | None = None, name: str = "kvbridge-copy"):
        self.helpers = default_helpers() if helpers is None else max(0, helpers)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(self.helpers)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.work()

    def __call__(self, pieces: list[Callable[[], object]]) -> None:
        job = _Job(list(pieces))
        if not job.pieces:
            return
        for _ in range(min(self.helpers, len(job.pieces) - 1)):
            self._jobs.put(job)
        job.work()
        job.done.wait()
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """Stop the helper threads (after the jobs already queued)."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(5)
        self._threads = []
