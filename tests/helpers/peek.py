"""Reads of kvbridge objects' inner state that only tests need (the product never asks
for them), each under the lock the object guards that state with."""

from __future__ import annotations


def ordered_calls_threaded(oc) -> bool:
    """``OrderedCalls``: whether calls now go through its thread (one brought an event)."""
    with oc._lock:
        return oc._q is not None


def registered_ranges(transport) -> dict[int, int]:
    """``MooncakeTransport``: registered memory, ``{addr: nbytes}`` in address order."""
    with transport._lock:
        return dict(sorted(transport._registry.items()))


def ready_ids(wake) -> list[int]:
    """``IdleWake``: requests whose blocks every rank let go of, not yet taken by an iteration."""
    with wake._lock:
        return list(wake._ready)
