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

from typing import Any

from kvbridge.common.handles import FIELDS as ALL_FIELDS
from kvbridge.common.handles import Handle, HandleError

__all__ = ["FIELDS", "KEY", "Handle", "HandleError", "handle_of", "to_params"]

KEY = "kvbridge"
FIELDS = ("op", "room", "bootstrap", "endpoints")  # what this plugin serves of the shared handle


def to_params(handle: Handle) -> dict[str, Any]:
    """``kv_transfer_params`` that carry ``handle``."""
    bad = sorted(f for f in ALL_FIELDS if f not in FIELDS and getattr(handle, f))
    if bad:
        raise HandleError(f"room {handle.room}: the vLLM plugin does not serve handle fields {bad}")
    return {KEY: handle.to_dict()}


def handle_of(params: Any) -> Handle | None:
    """The handle in a request's ``kv_transfer_params`` (None when it has none);
    HandleError naming what is wrong with one that is there."""
    if not isinstance(params, dict) or KEY not in params:
        return None
    return Handle.from_dict(params[KEY], fields=FIELDS, what=f"kv_transfer_params[{KEY!r}]")
