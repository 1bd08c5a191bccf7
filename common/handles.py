"""What every engine's handoff handle must hold, checked once for all adapters.

A handle names one server's part in a handoff: ``op`` ("send" on the prefill, "recv" on
the decode), the router's ``room`` id, and on a decode half where to find the prefill
(an SGLang-compatible ``bootstrap`` address ``host:port``, or the prefill ranks'
``tcp://`` endpoints). Each adapter carries it in its engine's own request field.
"""

from __future__ import annotations

from typing import Any, Sequence

from .bootstrap import parse_address

__all__ = ["HandleError", "check_handle"]


class HandleError(ValueError):
    """A handle that is not valid (the message names the field)."""


def check_handle(op: Any, room: Any, *, bootstrap: str = "", endpoints: Sequence[Any] = (),
                 decode_needs: str = "'bootstrap' or 'endpoints'") -> None:
    """Raise HandleError naming the field when ``op``/``room``/the peer fields are not a
    valid handle: a prefill half names no peer, a decode half names one (``decode_needs``
    says which fields the adapter accepts), ``room`` is a non-negative 64-bit integer,
    ``bootstrap`` is ``host:port``, every endpoint is a ``tcp://`` address."""
    if op not in ("send", "recv"):
        raise HandleError(f"handle op must be 'send' or 'recv', got {op!r}")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        raise HandleError(f"handle room must be a non-negative 64-bit integer, got {room!r}")
    if op == "recv" and not (bootstrap or endpoints):
        raise HandleError(f"room {room}: a decode handle needs {decode_needs}")
    if op == "send" and (bootstrap or endpoints):
        raise HandleError(f"room {room}: a prefill handle names no peer")
    if bootstrap:
        try:
            parse_address(bootstrap)
        except ValueError as e:
            raise HandleError(f"room {room}: {e}") from None
    for ep in endpoints:
        if not isinstance(ep, str) or not ep.startswith("tcp://"):
            raise HandleError(f"room {room}: endpoint {ep!r} is not a tcp:// address")
