"""Bounds on what a peer can make this process hold or write: rate-limited warnings and
peer-keyed maps with a size cap (the oldest entry goes first, counted).

Example::

    >>> seen = BoundedMap(2, name="demo")
    >>> seen["a"], seen["b"], seen["c"] = 1, 2, 3
    >>> list(seen), seen.evicted
    (['b', 'c'], 1)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable

__all__ = ["BoundedMap", "LogLimiter"]


class LogLimiter:
    """Warnings of one kind (``key``) at most once per ``every_s``, each with how many
    were suppressed since the last: a flood of bad frames costs one log line a second."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = 1.0):
        self.log, self.what, self.every_s = log, what, every_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last logged, suppressed since); keys are our codes
        self._lock = threading.Lock()

    def warn(self, key: str, fmt: str, *args) -> bool:
        """Log ``fmt % args`` under ``key`` unless one was logged within ``every_s``;
        True when it was logged (the caller may answer the peer then, too)."""
        now = time.monotonic()
        with self._lock:
            last, dropped = self._last.get(key, (-1e18, 0))
            if now - last < self.every_s:
                self._last[key] = (last, dropped + 1)
                return False
            self._last[key] = (now, 0)
        more = f" ({dropped} more since the last)" if dropped else ""
        self.log.warning(f"%s [%s]{more}: {fmt}", self.what, key, *args)
        return True


class BoundedMap(OrderedDict):
    """A dict keyed by peer data holding at most ``cap`` entries: inserting past the cap
    drops the oldest and calls ``on_evict(name)``; ``evicted`` counts them. Oldest: by
    insertion, or with ``lru`` by last write (a write moves the key to the end). Reading
    does not refresh an entry. Not thread-safe (its owner's lock or thread guards it)."""

    def __init__(self, cap: int, *, name: str = "", on_evict: Callable[[str], None] | None = None, lru: bool = False):
        super().__init__()
        if cap < 1:
            raise ValueError(f"BoundedMap {name!r}: cap must be >= 1, got {cap}")
        self.cap, self.name, self.evicted, self.lru = int(cap), name, 0, lru
        self._on_evict = on_evict

    def __setitem__(self, key: Hashable, value) -> None:
        if key in self:
            if self.lru:
                self.move_to_end(key)
        else:
            while len(self) >= self.cap:
                self.popitem(last=False)
                self.evicted += 1
                if self._on_evict is not None:
                    self._on_evict(self.name)
        super().__setitem__(key, value)

    def __reduce__(self):  # pragma: no cover - never pickled; keeps OrderedDict's default from dropping cap
        return (dict, (dict(self),))
