"""How a per-request object's failure is recorded and kept off SGLang's event loop."""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["recorded_failure", "fails_the_request"]

log = logging.getLogger(__name__)


def recorded_failure(obj) -> str:
    """What SGLang recorded as the reason a sender/receiver failed ('' if nothing), without
    consuming it (``failure_exception`` pops it)."""
    mgr = obj.kv_mgr
    with mgr.failure_lock:
        return str(mgr.failure_records.get(obj.bootstrap_room, "") or "")


def fails_the_request(result: Any = None):
    """For the methods of a sender/receiver that SGLang's scheduler calls on its event loop:
    an exception fails that request (reason recorded, ``_kvb_fail``) and the method returns
    ``result``; it never reaches the scheduler, which would go down with it."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as e:
                log.exception("kvbridge: room %s: %s.%s raised", self.bootstrap_room, type(self).__name__,
                              method.__name__)
                try:
                    self._kvb_fail(f"kvbridge: internal error in {type(self).__name__}.{method.__name__}: {e!r}")
                except Exception:  # pragma: no cover - the last line of defence must not raise either
                    log.exception("kvbridge: room %s: failing it raised too", self.bootstrap_room)
                return result

        return guarded

    return wrap
