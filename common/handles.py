"""The handoff handle every plugin and the router share, checked once for all.

A handle names one server's part in a handoff: ``op`` ("send" on the prefill, "recv" on
the decode), the router's ``room`` id, and on a decode half where to find the prefill:
an SGLang-compatible ``bootstrap`` address ``host:port``, the prefill ranks' ``tcp://``
``endpoints`` (TP order), or a TensorRT-LLM prefill's bus (``prefill``, a ``tcp://``
address; the TensorRT-LLM plugin asks it for the ranks). ``on_failure`` ("recompute" |
"fail") overrides the decode server's setting for this request. Each plugin carries the
handle in its engine's own request field (vLLM: ``kv_transfer_params``; TensorRT-LLM:
announced under the prompt) and reads only the fields it serves (``Handle.from_dict``'s
``fields``)::

    Handle("send", room)                                      prefill half
    Handle("recv", room, bootstrap="p:8998")                  decode half: an SGLang-compatible bootstrap server
    Handle("recv", room, endpoints=("tcp://...", ...))         decode half: the prefill's ranks, TP order
    Handle("recv", room, prefill="tcp://p:18500")             decode half: a TensorRT-LLM prefill's bus
"""

from __future__ import annotations

from typing import Annotated, Any, Sequence

import msgspec
from msgspec import Meta

from .bootstrap import parse_address

__all__ = ["FIELDS", "Handle", "HandleError", "check_handle"]

FIELDS = ("op", "room", "bootstrap", "endpoints", "prefill", "on_failure")  # every field, in to_dict's order


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


_Addr = Annotated[str, Meta(max_length=256)]


class Handle(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One server's part in a handoff (see the module docstring). A msgspec struct: it
    crosses a bus typed (checked by ``__post_init__`` on decode too), ``to_dict`` is its
    JSON form."""

    op: str  # "send" (prefill) or "recv" (decode)
    room: int
    bootstrap: _Addr = ""
    endpoints: Annotated[tuple[_Addr, ...], Meta(max_length=1 << 10)] = ()
    prefill: _Addr = ""
    on_failure: Annotated[str, Meta(max_length=16)] = ""

    def __post_init__(self) -> None:
        check_handle(self.op, self.room, bootstrap=self.bootstrap,
                     endpoints=((self.prefill,) if self.prefill else ()) + tuple(self.endpoints),
                     decode_needs="'bootstrap', 'endpoints' or 'prefill'")
        if self.on_failure not in ("", "recompute", "fail"):
            raise HandleError(f"room {self.room}: on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as JSON/msgpack-ready values."""
        d = msgspec.to_builtins(self)
        if "endpoints" in d:
            d["endpoints"] = list(d["endpoints"])
        return d

    @classmethod
    def from_dict(cls, d: Any, *, fields: Sequence[str] = FIELDS, what: str = "handle") -> "Handle":
        """A handle from ``to_dict``'s form; HandleError naming what is wrong. ``fields``:
        the ones the reading plugin serves (any other is refused by name); ``what`` names
        the handle in messages."""
        if not isinstance(d, dict):
            raise HandleError(f"{what} must be a mapping, got {type(d).__name__}")
        extra = set(d) - set(fields)
        if extra:
            raise HandleError(f"{what} has unknown fields {sorted(extra)}")
        eps = d.get("endpoints", ())
        if not isinstance(eps, (list, tuple)):
            raise HandleError(f"{what}: 'endpoints' must be a list")
        for name in ("op", "bootstrap", "prefill", "on_failure"):
            if not isinstance(d.get(name, ""), str):
                raise HandleError(f"{what}: {name!r} must be a string")
        peers = [f for f in ("bootstrap", "endpoints", "prefill") if f in fields]
        if d.get("op") == "recv" and not any(d.get(f) for f in peers):  # name only what this plugin reads
            check_handle("recv", d.get("room"), decode_needs=" or ".join(repr(f) for f in peers))
        return cls(op=d.get("op", ""), room=d.get("room"), bootstrap=d.get("bootstrap", ""), endpoints=tuple(eps),
                   prefill=d.get("prefill", ""), on_failure=d.get("on_failure", ""))
