"""Blocks leased to one handoff, released exactly once whatever happens."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

__all__ = ["BlockLease"]

log = logging.getLogger(__name__)


class BlockLease:
    """The blocks one side allocated for one room.

    ``release(success)`` hands them back to the engine through ``on_release(blocks,
    success)`` exactly once: on the receiver, success means the blocks now hold the
    request's KV (the engine keeps them), failure means they are free again; on the
    sender, the KV has been delivered or given up. Later calls are no-ops that return
    False and are logged.
    """

    def __init__(self, room: int, blocks, on_release: Callable[[np.ndarray, bool], None] | None, on_count=None):
        self.room = room
        self.blocks = np.asarray(blocks, dtype=np.int64).copy()
        self._on_release = on_release
        self._on_count = on_count
        self._lock = threading.Lock()
        self._released = False
        if on_count:
            on_count(+self.blocks.size)

    @property
    def released(self) -> bool:
        """True once the blocks went back to the engine."""
        return self._released

    def release(self, success: bool) -> bool:
        """Hand the blocks back once; returns whether this call did."""
        with self._lock:
            if self._released:
                log.warning("room %s: blocks already released; ignoring a second release", self.room)
                return False
            self._released = True
        if self._on_count:
            self._on_count(-self.blocks.size)
        if self._on_release is not None:
            try:
                self._on_release(self.blocks, success)
            except Exception:  # the engine's callback must not break the handoff machinery
                log.exception("room %s: release callback failed", self.room)
        return True
