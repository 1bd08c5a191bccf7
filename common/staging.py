"""Byte ranges of a registered staging buffer, handed out first-fit (a receiver's staging
for ``staged_recv`` plans: one slice per sender of a room)."""

from __future__ import annotations

import threading

__all__ = ["Arena"]


class Arena:
    """First-fit allocator of byte ranges in one registered staging buffer (thread-safe:
    ``_lock`` guards the free list)."""

    def __init__(self, size: int, align: int = 256):
        self.size, self.align = size, align
        self._free: list[tuple[int, int]] = [(0, size)] if size else []
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = -(-n // self.align) * self.align
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= n:
                    self._free[i] = (off + n, ln - n)
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        n = -(-n // self.align) * self.align
        with self._lock:
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                elif ln:
                    merged.append((o, ln))
            self._free = merged
