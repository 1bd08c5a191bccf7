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

The handle is the one every plugin shares (``kvbridge.common.handles.Handle``); this
plugin serves all its fields: a decode half may name a TensorRT-LLM prefill's bus
(``prefill``), the prefill's ranks (``endpoints``) or an SGLang-compatible bootstrap
server (``bootstrap``). ``room`` is the router's id for the handoff (with an SGLang
prefill: the request's ``bootstrap_room``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from typing import Sequence

import numpy as np

from kvbridge.common.handles import Handle, HandleError

__all__ = ["Handle", "HandleError", "AnnounceError", "announce", "prompt_key"]


class AnnounceError(RuntimeError):
    """A server did not take an announced handle (unreachable, or refused with a reason)."""


def prompt_key(token_ids: Sequence[int]) -> str:
    """The key a handle is announced under: a 128-bit hash of the prompt's token ids."""
    arr = np.asarray(list(token_ids), dtype=np.int64)
    if arr.size == 0:
        raise HandleError("an empty prompt has no key")
    return hashlib.blake2b(arr.tobytes(), digest_size=16, person=b"kvbridge-prompt").hexdigest()


_nonces = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)


def announce(bus: str, prompt_token_ids: Sequence[int], handle: Handle, *, ttl_s: float = 60.0,
             timeout_s: float = 5.0, keyring=None) -> None:
    """Tell the TensorRT-LLM server whose bus is ``bus`` (its kvbridge scheduler,
    ``tcp://host:bus_port``) that its next request with this prompt plays ``handle``.
    Returns once the server has it; call it before sending the request. Raises
    AnnounceError when the server does not answer in ``timeout_s`` or refuses.
    ``keyring``: the deployment's ``Keyring`` (default: the shared settings', e.g.
    ``KVBRIDGE_SECRET``), the announcement and its answer are sealed with it."""
    import zmq

    from kvbridge.common.auth import AuthError
    from kvbridge.common.settings import BridgeSettings

    from . import bus as B

    if keyring is None:
        keyring = BridgeSettings.load().keyring()

    key = prompt_key(prompt_token_ids)
    nonce = next(_nonces)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(bus)
        sock.send(B.pack(B.Expect(key=key, handle=handle, ttl_s=float(ttl_s), nonce=nonce), keyring))
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
