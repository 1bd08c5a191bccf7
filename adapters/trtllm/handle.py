"""How a TensorRT-LLM request is tied to its handoff: a handle announced by content.

TensorRT-LLM hands the connector nothing a router could put a handle in, on either
supported version: ``get_num_new_matched_tokens`` (where a decode server decides to
load) receives a C++ request copy with only the bound names (no ``py_*`` attribute), and
the 1.2 Python request has no ``py_disaggregated_params`` at all. What both hooks do see
is the prompt (``request.get_tokens(0)[:request.prompt_len]``).

So a router *announces* each half to the server that will run it, keyed by the prompt,
before sending the request (``announce``): the server's rank-0 connector keeps the
handle for ``ttl_s`` and gives it to the next request with that prompt. Two requests with
the same prompt take the announced handles in order; their KV is the same bytes either
way. A request nobody announced is served as usual.

A handle says which side this server plays and where the other side is::

    Handle("send", room)                                      prefill half
    Handle("recv", room, prefill="tcp://p:18500")             decode half: a TensorRT-LLM prefill's bus
    Handle("recv", room, endpoints=("tcp://...", ...))         decode half: the prefill's ranks, TP order
    Handle("recv", room, bootstrap="p:8998")                  decode half: an SGLang (or SGLang-compatible) prefill

``room`` is the router's id for the handoff (with an SGLang prefill: the request's
``bootstrap_room``). ``on_failure`` ("recompute" | "fail") overrides the decode server's
setting for this request.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvbridge.common.handles import HandleError, check_handle

__all__ = ["Handle", "HandleError", "AnnounceError", "announce", "prompt_key"]


class AnnounceError(RuntimeError):
    """A server did not take an announced handle (unreachable, or refused with a reason)."""


def prompt_key(token_ids: Sequence[int]) -> str:
    """The key a handle is announced under: a 128-bit hash of the prompt's token ids."""
    arr = np.asarray(list(token_ids), dtype=np.int64)
    if arr.size == 0:
        raise HandleError("an empty prompt has no key")
    return hashlib.blake2b(arr.tobytes(), digest_size=16, person=b"kvbridge-prompt").hexdigest()


@dataclass(frozen=True)
class Handle:
    """One server's part in a handoff."""

    op: str  # "send" (prefill) or "recv" (decode)
    room: int
    prefill: str = ""
    endpoints: tuple[str, ...] = ()
    on_failure: str = ""
    bootstrap: str = ""

    def __post_init__(self) -> None:
        check_handle(self.op, self.room, bootstrap=self.bootstrap,
                     endpoints=((self.prefill,) if self.prefill else ()) + tuple(self.endpoints),
                     decode_needs="'prefill', 'endpoints' or 'bootstrap'")
        if self.on_failure not in ("", "recompute", "fail"):
            raise HandleError(f"room {self.room}: on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "room": self.room}
        for name in ("prefill", "on_failure", "bootstrap"):
            if getattr(self, name):
                d[name] = getattr(self, name)
        if self.endpoints:
            d["endpoints"] = list(self.endpoints)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Handle":
        """A handle from ``to_dict``'s form; HandleError naming what is wrong."""
        if not isinstance(d, dict):
            raise HandleError(f"a handle is a mapping, got {type(d).__name__}")
        extra = set(d) - {"op", "room", "prefill", "endpoints", "on_failure", "bootstrap"}
        if extra:
            raise HandleError(f"handle has unknown fields {sorted(extra)}")
        eps = d.get("endpoints", ())
        if not isinstance(eps, (list, tuple)):
            raise HandleError("handle 'endpoints' must be a list")
        for name in ("prefill", "on_failure", "bootstrap", "op"):
            if not isinstance(d.get(name, ""), str):
                raise HandleError(f"handle {name!r} must be a string")
        return cls(op=d.get("op", ""), room=d.get("room"), prefill=d.get("prefill", ""), endpoints=tuple(eps),
                   on_failure=d.get("on_failure", ""), bootstrap=d.get("bootstrap", ""))


_nonces = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)


def announce(bus: str, prompt_token_ids: Sequence[int], handle: Handle, *, ttl_s: float = 60.0,
             timeout_s: float = 5.0, keyring=None) -> None:
    """Tell the TensorRT-LLM server whose bus is ``bus`` (its kvbridge scheduler,
    ``tcp://host:bus_port``) that its next request with this prompt plays ``handle``.
    Returns once the server has it; call it before sending the request. Raises
    AnnounceError when the server does not answer in ``timeout_s`` or refuses.
    ``keyring``: the deployment's ``Keyring`` (default: one for ``KVBRIDGE_SECRET``), the
    announcement and its answer are sealed with it."""
    import zmq

    from kvbridge.common.auth import AuthError, Keyring

    from . import bus as B

    if keyring is None:
        keyring = Keyring.from_env()

    key = prompt_key(prompt_token_ids)
    nonce = next(_nonces)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(bus)
        sock.send(B.pack(B.Expect(key=key, handle=handle.to_dict(), ttl_s=float(ttl_s), nonce=nonce), keyring))
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise AnnounceError(f"{bus} did not answer the announcement of room {handle.room} within {timeout_s:.1f} s")
            try:
                msg = B.unpack(sock.recv(), keyring)
            except (B.BusError, AuthError) as e:
                raise AnnounceError(f"{bus}: {e}") from None
            if isinstance(msg, B.Expected) and msg.nonce == nonce:
                if not msg.ok:
                    raise AnnounceError(f"{bus} refused room {handle.room}: {msg.reason}")
                return
    finally:
        sock.close(0)
