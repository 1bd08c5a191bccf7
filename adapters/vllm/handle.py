"""How a vLLM request is tied to its handoff: a handle in the request's ``kv_transfer_params``.

vLLM carries ``kv_transfer_params`` (a JSON object in the OpenAI request body, or
``SamplingParams.extra_args["kv_transfer_params"]``) to its KV connector with the request
(``Request.kv_transfer_params``), and returns what the connector's ``request_finished``
gives back in the response's ``kv_transfer_params``. kvbridge reads one key of it::

    {"kvbridge": {"op": "send", "room": R}}                                 prefill half
    {"kvbridge": {"op": "recv", "room": R, "bootstrap": "host:port"}}       decode half: the prefill's
                                                                            bootstrap server (vLLM or SGLang
                                                                            prefill, TensorRT-LLM's with one)
    {"kvbridge": {"op": "recv", "room": R, "endpoints": ["tcp://..."]}}     decode half: the prefill ranks'
                                                                            kvbridge endpoints, TP order

``room`` is the router's id for the handoff (with an SGLang prefill: its
``bootstrap_room``). A prefill half's response carries the decode half's handle
(``{"kvbridge": {"op": "recv", "room": R, "bootstrap": ...}}``), so a router that sends
the halves one after the other can pass it on unchanged. A request without the key is
served as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.common.handles import HandleError, check_handle

__all__ = ["KEY", "Handle", "HandleError", "handle_of"]

KEY = "kvbridge"


@dataclass(frozen=True)
class Handle:
    """One server's part in a handoff."""

    op: str  # "send" (prefill) or "recv" (decode)
    room: int
    bootstrap: str = ""
    endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_handle(self.op, self.room, bootstrap=self.bootstrap, endpoints=self.endpoints)

    def to_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` that carry this handle."""
        d: dict[str, Any] = {"op": self.op, "room": self.room}
        if self.bootstrap:
            d["bootstrap"] = self.bootstrap
        if self.endpoints:
            d["endpoints"] = list(self.endpoints)
        return {KEY: d}


def handle_of(params: Any) -> Handle | None:
    """The handle in a request's ``kv_transfer_params`` (None when it has none);
    HandleError naming what is wrong with one that is there."""
    if not isinstance(params, dict) or KEY not in params:
        return None
    d = params[KEY]
    if not isinstance(d, dict):
        raise HandleError(f"kv_transfer_params[{KEY!r}] must be an object, got {type(d).__name__}")
    extra = set(d) - {"op", "room", "bootstrap", "endpoints"}
    if extra:
        raise HandleError(f"kvbridge handle has unknown fields {sorted(extra)}")
    eps = d.get("endpoints", ())
    if not isinstance(eps, (list, tuple)) or not isinstance(d.get("bootstrap", ""), str) \
            or not isinstance(d.get("op", ""), str):
        raise HandleError("kvbridge handle: 'op' and 'bootstrap' must be strings, 'endpoints' a list")
    return Handle(op=d.get("op", ""), room=d.get("room"), bootstrap=d.get("bootstrap", ""), endpoints=tuple(eps))
