"""How a TensorRT-LLM request says which handoff it belongs to.

A request carries a kvbridge *handle* in ``DisaggregatedParams.opaque_state`` (bytes;
over trtllm-serve's OpenAI API: ``disaggregated_params.encoded_opaque_state``, base64),
with ``request_type="context_and_generation"`` so TensorRT-LLM accepts it without a
cache transceiver. TensorRT-LLM's PyTorch backend copies the params onto the executor
request (``executor_request.py_disaggregated_params``) and every rank's ``LlmRequest``
has them as ``py_disaggregated_params``.

The handle is JSON::

    {"kvbridge": 1, "op": "send", "room": 42}                          prefill request
    {"kvbridge": 1, "op": "recv", "room": 42, "prefill": "tcp://p:18500"}  decode request
    {"kvbridge": 1, "op": "recv", "room": 42, "endpoints": ["tcp://...", ...]}
    {"kvbridge": 1, "op": "recv", "room": 42, "bootstrap": "p:8998"}   decode from an SGLang prefill

``room`` is the router's id for the handoff (unique among the prefill server's open
handoffs). A decode handle names the prefill server by its discovery endpoint
(``prefill``: the prefill's rank-0 bus, which answers with every rank's control
endpoint), by the control endpoints themselves, in tensor-parallel rank order, or by an
SGLang bootstrap address (``bootstrap``: ``host:port`` of an SGLang prefill server on
the kvbridge backend, or of a TensorRT-LLM prefill with ``sglang_bootstrap_port`` set);
the connector then asks that server for the prefill's ranks (``GET /kvbridge/ranks``).
With an SGLang prefill the room is the request's ``bootstrap_room``.
``on_failure`` ("recompute" | "fail") overrides the decode server's setting for this
request.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from kvbridge.common.bootstrap import parse_address

__all__ = ["Handle", "HandleError", "handle_of", "prefill_params", "decode_params", "encode_handle"]

_VERSION = 1


class HandleError(ValueError):
    """A request's kvbridge handle that cannot be read."""


@dataclass(frozen=True)
class Handle:
    """One request's part in a handoff."""

    op: str  # "send" (prefill) or "recv" (decode)
    room: int
    prefill: str = ""
    endpoints: tuple[str, ...] = ()
    on_failure: str = ""
    bootstrap: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise HandleError(f"handle op must be 'send' or 'recv', got {self.op!r}")
        if not isinstance(self.room, int) or not 0 <= self.room < 2**63:
            raise HandleError(f"handle room must be a non-negative 64-bit integer, got {self.room!r}")
        if self.op == "recv" and not (self.prefill or self.endpoints or self.bootstrap):
            raise HandleError(f"room {self.room}: a decode handle needs 'prefill', 'endpoints' or 'bootstrap'")
        if self.bootstrap:
            try:
                parse_address(self.bootstrap)
            except ValueError as e:
                raise HandleError(f"room {self.room}: {e}") from None
        for ep in ((self.prefill,) if self.prefill else ()) + self.endpoints:
            if not isinstance(ep, str) or not ep.startswith("tcp://"):
                raise HandleError(f"room {self.room}: endpoint {ep!r} is not a tcp:// address")
        if self.on_failure not in ("", "recompute", "fail"):
            raise HandleError(f"room {self.room}: on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")

    def to_json(self) -> bytes:
        """The handle as ``opaque_state`` bytes."""
        d: dict[str, Any] = {"kvbridge": _VERSION, "op": self.op, "room": self.room}
        if self.prefill:
            d["prefill"] = self.prefill
        if self.endpoints:
            d["endpoints"] = list(self.endpoints)
        if self.on_failure:
            d["on_failure"] = self.on_failure
        if self.bootstrap:
            d["bootstrap"] = self.bootstrap
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Handle":
        """Parse ``opaque_state``; raises HandleError naming what is wrong."""
        try:
            d = json.loads(data)
        except (TypeError, ValueError, UnicodeDecodeError) as e:
            raise HandleError(f"opaque_state is not a kvbridge handle (not JSON: {e})") from None
        if not isinstance(d, dict) or d.get("kvbridge") != _VERSION:
            raise HandleError(f"opaque_state is not a version-{_VERSION} kvbridge handle: {str(d)[:200]}")
        extra = set(d) - {"kvbridge", "op", "room", "prefill", "endpoints", "on_failure", "bootstrap"}
        if extra:
            raise HandleError(f"kvbridge handle has unknown fields {sorted(extra)}")
        eps = d.get("endpoints", ())
        if not isinstance(eps, (list, tuple)):
            raise HandleError("kvbridge handle 'endpoints' must be a list")
        bootstrap = d.get("bootstrap", "")
        if not isinstance(bootstrap, str):
            raise HandleError("kvbridge handle 'bootstrap' must be a 'host:port' string")
        return cls(op=d.get("op", ""), room=d.get("room"), prefill=d.get("prefill", ""), endpoints=tuple(eps),
                   on_failure=d.get("on_failure", ""), bootstrap=bootstrap)


def handle_of(request: Any) -> Handle | None:
    """The kvbridge handle of a TensorRT-LLM ``LlmRequest`` (from
    ``py_disaggregated_params.opaque_state``), or None when it has none. Raises
    HandleError when it carries an ``opaque_state`` that starts like a kvbridge handle but is
    malformed."""
    params = getattr(request, "py_disaggregated_params", None)
    state = getattr(params, "opaque_state", None) if params is not None else None
    if not state:
        return None
    if isinstance(state, str):
        state = state.encode()
    if not bytes(state).lstrip().startswith(b"{") or b'"kvbridge"' not in bytes(state):
        return None  # someone else's opaque state
    return Handle.from_json(bytes(state))


def encode_handle(handle: Handle) -> str:
    """``handle`` as trtllm-serve's ``encoded_opaque_state`` (base64 text)."""
    return base64.b64encode(handle.to_json()).decode()


def prefill_params(room: int) -> dict[str, Any]:
    """``disaggregated_params`` (OpenAI-API form) for the prefill half of room ``room``."""
    return {"request_type": "context_and_generation", "encoded_opaque_state": encode_handle(Handle("send", room))}


def decode_params(room: int, prefill: str = "", endpoints=(), on_failure: str = "",
                  bootstrap: str = "") -> dict[str, Any]:
    """``disaggregated_params`` (OpenAI-API form) for the decode half of room ``room``."""
    h = Handle("recv", room, prefill=prefill, endpoints=tuple(endpoints), on_failure=on_failure, bootstrap=bootstrap)
    return {"request_type": "context_and_generation", "encoded_opaque_state": encode_handle(h)}
