"""A pool's free block ids, handed out and taken back as an engine's allocator does: the
load bench's workers and the test peers allocate each handoff's blocks from one."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["BlockFreeList"]


class BlockFreeList:
    """Free block ids ``[first, end)`` (thread-safe), in a seeded random order when ``seed``
    is given (scattered blocks), else in order; counts double frees."""

    def __init__(self, first: int, end: int, seed: int | None = None):
        ids = np.arange(first, end) if seed is None else np.random.default_rng(seed).permutation(np.arange(first, end))
        self._free = [int(b) for b in ids]
        self.total = end - first
        self.double_frees = 0
        self._cond = threading.Condition()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def alloc(self, n: int, timeout: float | None = None) -> np.ndarray | None:
        """``n`` block ids (int64). Short of blocks: with ``timeout`` None, RuntimeError;
        else wait up to ``timeout`` seconds for frees, then None."""
        with self._cond:
            if timeout is None:
                if n > len(self._free):
                    raise RuntimeError(f"out of blocks: want {n}, have {len(self._free)}")
            elif not self._cond.wait_for(lambda: len(self._free) >= n, timeout):
                return None
            out, self._free = self._free[:n], self._free[n:]
            return np.array(out, dtype=np.int64)

    def alloc_every_other(self, n: int) -> np.ndarray:
        """``n`` block ids with a free id between each (scattered destinations)."""
        with self._cond:
            out = sorted(self._free)[: 2 * n : 2]
            if len(out) < n:
                raise RuntimeError(f"out of blocks: want {n} with gaps, have {len(self._free)}")
            keep = set(out)
            self._free = [b for b in self._free if b not in keep]
            return np.array(out, dtype=np.int64)

    def free(self, blocks) -> None:
        """Take ``blocks`` back; one already free counts as a double free."""
        with self._cond:
            ids = [int(b) for b in blocks]
            if set(ids) & set(self._free):
                self.double_frees += 1
            self._free.extend(ids)
            self._cond.notify_all()
