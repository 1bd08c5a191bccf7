"""A prefill's kvbridge ranks, seen from the router: where they are, and aborting a room.

Where: a TensorRT-LLM decode is announced the prefill's rank endpoints themselves
(``Handle("recv", room, endpoints=...)``), looked up here once per server and again
after it failed or came back into rotation (the connector would otherwise keep the
endpoints it discovered first for that address: a restarted prefill's new ranks are
never found; see ``KVBridgeConnectorScheduler._discovered``).

Abort: when a decode half fails (or a prefill half is given up), the prefill may hold the
prompt's KV for a decode that will never ask. The router tells every kvbridge rank of
that prefill that the room is off: a kvbridge ``Abort`` (sealed with the deployment's
secret when one is set, as every control frame) on the control channel, as a declining decode sends it
(``KVReceiver.decline``). A sender ends the room and releases its blocks at once, or as
soon as its engine adds the room when the request is still queued
(``KVSender._on_abort``). An unknown room is answered and forgotten.

The ranks' endpoints come from the prefill's bootstrap server (``GET /kvbridge/ranks``:
SGLang on the kvbridge backend, or a TensorRT-LLM prefill with ``sglang_bootstrap_port``)
or, for a TensorRT-LLM prefill, from its bus (``Who`` -> ``Endpoints``); they are looked
up once per server and again after a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .config import ServerSpec

__all__ = ["PrefillRanks", "bus_endpoints", "bootstrap_endpoints"]

log = logging.getLogger(__name__)


def bus_endpoints(bus: str, timeout_s: float = 2.0, keyring=None) -> list[str]:
    """A TensorRT-LLM server's rank endpoints, asked on its kvbridge bus (``Who``, sealed
    with ``keyring`` when one is given). Raises TimeoutError or ValueError (a bad answer)."""
    import zmq

    from kvbridge.adapters.trtllm import bus as B

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(bus)
        sock.send(B.pack(B.Who(), keyring))
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"bus {bus} did not answer Who within {timeout_s:g} s")
            msg = B.unpack(sock.recv(), keyring)
            if isinstance(msg, B.Endpoints):
                return list(msg.endpoints)
    finally:
        sock.close(0)


def bootstrap_endpoints(address: str, timeout_s: float = 2.0, keyring=None) -> list[str]:
    """A prefill's rank endpoints from its bootstrap server (``/kvbridge/ranks``); with
    ``keyring`` only rank records sealed by the deployment are taken."""
    from kvbridge.common.bootstrap import endpoints_by_tp_rank, fetch_ranks

    return endpoints_by_tp_rank(fetch_ranks(address, timeout_s, keyring=keyring), address)


def route_keyring(secret: str = ""):
    """The router's ``Keyring``: the deployment's shared settings (``KVBRIDGE_SECRET``,
    ``KVBRIDGE_ACCEPTED_SECRETS``, ``KVBRIDGE_REPLAY_WINDOW_S``...), with its config's
    ``secret`` when set (None: no secret)."""
    from kvbridge.common.settings import BridgeSettings

    return BridgeSettings.load(overrides={"secret": secret} if secret else None).keyring()


class PrefillRanks:
    """Prefill rank endpoints (cached per server) and room aborts to them; one control
    channel for the router."""

    def __init__(self, keyring=None):
        self.keyring = keyring  # the servers' key (route_keyring), or None
        self._eps: dict[str, list[str]] = {}
        self._chan = None
        self.sent = 0
        self._unacked: dict[int, float] = {}  # room -> when its abort was sent (monotonic)

    def _channel(self):
        if self._chan is None:
            from kvbridge.common.control import ControlChannel

            # replies (TransferFailed "abort acknowledged", Heartbeat) need no action but show delivery
            self._chan = ControlChannel(self._on_reply, name="kvbridge-route-ranks")
        return self._chan

    def _on_reply(self, peer: str, payload: bytes) -> None:
        from kvbridge.common import protocol as P

        try:
            msg = P.unpack(payload, self.keyring, P.link(peer, to_prefill=False))
        except Exception:  # unsigned, stale, malformed: no reply changes anything here
            return
        room = getattr(msg, "room", None)
        if isinstance(msg, P.TransferFailed) and room is not None:
            self._unacked.pop(room, None)

    async def endpoints(self, server: ServerSpec, timeout_s: float = 2.0) -> list[str]:
        """The server's rank endpoints (cached)."""
        eps = self._eps.get(server.name)
        if eps is None:
            if server.bootstrap:
                eps = await asyncio.to_thread(bootstrap_endpoints, server.bootstrap, timeout_s, self.keyring)
            elif server.bus:
                eps = await asyncio.to_thread(bus_endpoints, server.bus, timeout_s, self.keyring)
            else:
                raise ValueError(f"{server.name}: neither a bootstrap address nor a bus to find its ranks")
            self._eps[server.name] = eps
        return eps

    async def abort(self, server: ServerSpec, room: int, reason: str) -> bool:
        """Tell every rank of ``server`` that ``room`` is off; False when its ranks cannot
        be found (a dead server holds nothing)."""
        from kvbridge.common import protocol as P

        try:
            eps = await self.endpoints(server)
        except Exception as e:  # unreachable: nothing to abort there, or it is gone
            self._eps.pop(server.name, None)
            log.info("route: cannot abort room %s on %s: %s", room, server.name, e)
            return False
        body = P.encode(P.Abort(room=int(room), reason=reason[:4000]))
        chan = self._channel()
        for ep in eps:  # sealed for each rank's link: a frame for one rank is refused by every other
            chan.send(ep, P.seal(body, self.keyring, P.link(ep, to_prefill=True)))
        self.sent += 1
        self._unacked[int(room)] = time.monotonic()
        log.info("route: room %s aborted on %s (%d rank(s)): %s", room, server.name, len(eps), reason)
        return True

    def forget(self, server: ServerSpec) -> None:
        """Look the server's ranks up again next time (it restarted)."""
        self._eps.pop(server.name, None)

    async def flush(self, timeout_s: float = 2.0, grace_s: float = 0.5) -> int:
        """Before ``close``: wait until every abort sent was acknowledged by the prefill or
        has had ``grace_s`` to leave (a first message to a rank waits for its connection;
        closing drops what is still queued), at most ``timeout_s``. The aborts still
        unconfirmed."""
        end = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            young = [t for t in list(self._unacked.values()) if now - t < grace_s]
            if not young or now >= end:
                break
            await asyncio.sleep(min(0.02, end - now))
        left = len(self._unacked)
        if left:
            log.info("route: %d room abort(s) not acknowledged before closing", left)
        return left

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
