"""What a room's two sides share: its states, the metrics, and the
control-side base class (layout, transport, control channel, peer liveness).

A *room* is one request's handoff: the prefill rank's ``KVSender`` serves it, each decode
rank pulling it has a ``KVReceiver`` room (``kvbridge.common.sender`` and ``.receiver``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Callable

import msgspec

from kvbridge.layout import KVLayout

from . import protocol as P
from .auth import MAGIC, AuthError, check_bind
from .control import ControlChannel
from .limits import BoundedMap, LogLimiter
from .metrics import KVBridgeMetrics
from .settings import BridgeSettings, HandoffConfig
from .transport import MooncakeTransport

__all__ = ["RoomState", "PeerState", "TERMINAL", "HandoffConfig", "HandoffFailed", "ControlSide", "default_metrics"]

log = logging.getLogger(__name__)


class RoomState(enum.IntEnum):
    """Where a room is; ordered so that the minimum over ranks is the request's state."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    TRANSFERRING = 3
    SUCCESS = 4


TERMINAL = (RoomState.FAILED, RoomState.SUCCESS)


class PeerState(str, enum.Enum):
    """Where one prefill peer of a receiver's room is."""

    PENDING = "pending"  # asked; it may be writing into the room's blocks
    SCATTERING = "scattering"  # done writing; our scatter into the blocks, or our content check, is running
    DONE = "done"  # its part has landed (every write of it completed)
    STOPPING = "stopping"  # failed, told to stop, or silent: it may still be writing (not proven quiet)
    FAILED = "failed"  # proven quiet: it acknowledged with nothing in flight, or its process is gone


MAX_PEERS = 1 << 16  # peers one side keeps liveness (and refusal notes) for; the least recently heard goes first
MAX_PEER_LAYOUTS = 256  # peers whose parsed layout one side keeps; the least recently described goes first

_METRICS: KVBridgeMetrics | None = None
_METRICS_LOCK = threading.Lock()


def default_metrics() -> KVBridgeMetrics:
    """The process's Prometheus metrics (created on first use, in the default registry)."""
    global _METRICS
    with _METRICS_LOCK:
        if _METRICS is None:
            _METRICS = KVBridgeMetrics()
        return _METRICS


class HandoffFailed(RuntimeError):
    """A room failed; ``reason`` says why."""


class ControlSide:
    """What both sides share: layout, transport, control channel, peer liveness.

    Threads: the control channel's I/O thread runs ``_on_frame`` / ``_on_message`` and
    ``_on_tick``; engine threads call the public methods; ``_lock`` guards the rooms and
    their state, and ``_peer_layouts``. ``_peers_seen`` (peer -> when it last spoke) is
    written by the I/O thread only; other threads read it (a float per key: a stale read
    only delays a timeout)."""

    role = ""

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, config: HandoffConfig | None,
                 metrics: KVBridgeMetrics | None, bind_host: str | None):
        self.layout = layout
        self.transport = transport
        if config is None:  # the default settings'
            config = BridgeSettings().handoff()
        self.config = config
        self.metrics = metrics or default_metrics()
        self._lock = threading.RLock()
        # authenticated peers only (with a secret); the cap is far above any fleet, and bounds the no-secret case
        self._peers_seen: dict[str, float] = BoundedMap(MAX_PEERS, name="peers_seen", on_evict=self._evicted, lru=True)
        try:
            self._keyring = self.config.keyring()
            if bind_host is not None:
                check_bind(bind_host, self.config.secret, self.config.allow_insecure, f"kvbridge {self.role} control endpoint")
        except ValueError as e:
            raise HandoffFailed(f"{self.role}: {e}") from None
        self._bad_frames = LogLimiter(log, f"{self.role}: refused control frames")
        # peer -> why its last frame was refused: a room that fails for its silence says so
        self._refusals = BoundedMap(MAX_PEERS, name="auth_refusals", on_evict=self._evicted, lru=True)
        self._answered = BoundedMap(MAX_PEERS, name="auth_answers", on_evict=self._evicted, lru=True)  # peer -> last refusal sent
        self._frame_at = 0.0  # when the frame being handled arrived (I/O thread only)
        # peer -> (its last layout description, the layout parsed and checked from it)
        self._peer_layouts = BoundedMap(MAX_PEER_LAYOUTS, name="peer_layouts", lru=True)
        self.channel = ControlChannel(self._on_frame, self._on_tick, bind_host=bind_host,
                                      on_disconnect=self._on_disconnect if bind_host is None else None,
                                      name=f"kvbridge-{self.role}")

    def _peer_layout(self, peer: str, desc: P.LayoutDescription,
                     check: Callable[[KVLayout], None] | None = None) -> KVLayout:
        """``peer``'s layout from its description: parsed (and ``check``ed) the first time,
        reused while the peer describes the same layout. Raises LayoutError (or what
        ``check`` raises) naming what does not hold; nothing is kept then."""
        with self._lock:
            known = self._peer_layouts.get(peer)
        if known is not None and known[0] == desc:
            return known[1]
        layout = desc.to_layout()
        if check is not None:
            check(layout)
        with self._lock:
            self._peer_layouts[peer] = (desc, layout)
        return layout

    def _count_blocks(self, n: int) -> None:
        self.metrics.child(self.metrics.blocks_held, self.role).inc(n)

    def _send(self, peer: str, msg) -> None:
        if isinstance(msg, (P.TransferFailed, P.Abort)) and len(msg.reason) > 4000:
            msg = msgspec.structs.replace(msg, reason=msg.reason[:3990] + " [...]")
        self.channel.send(peer, P.pack(msg, self._keyring, self._link(peer, outgoing=True)))

    def _send_encoded(self, peer: str, data: bytes) -> None:
        """Send a message already encoded (and checked) by ``P.encode``: sealed here, not encoded again."""
        self.channel.send(peer, P.seal(data, self._keyring, self._link(peer, outgoing=True)))

    def _link(self, peer: str, *, outgoing: bool) -> bytes:
        """The domain of a frame to (``outgoing``) or from ``peer`` (``protocol.link``): a
        prefill side is itself the prefill end of every connection it has (its peers are
        decode ranks' routing ids); a decode side's peer is that prefill end."""
        if self.channel.endpoint:
            return P.link(self.channel.endpoint, to_prefill=not outgoing)
        return P.link(peer, to_prefill=outgoing)

    def _on_frame(self, peer: str, payload: bytes) -> None:
        self._frame_at = time.monotonic()
        try:
            msg = P.unpack(payload, self._keyring, self._link(peer, outgoing=False))
        except AuthError as e:
            self.metrics.refused("control", e.code)
            self._refusals[peer] = f"its frames are refused here: {e.code}: {e}"
            self._bad_frames.warn(e.code, "from %s: %s", peer, e)
            now = time.monotonic()
            if self._keyring is not None and self.channel.endpoint and now - self._answered.get(peer, -1e18) >= 1.0:
                # a bound side answers each peer at most once a second, with the bare refusal: a
                # decode with another key learns it (its keyring refuses the answer naming both
                # key ids, or, if it accepts ours, it fails its rooms at once); a decode never
                # answers one (two wrong keys would ping-pong)
                self._answered[peer] = now
                self._send(peer, P.TransferFailed(room=0, reason=f"frame refused: {e.code}", code="auth"))
            return
        except P.ProtocolError as e:
            self.metrics.refused("control", "bad_message")
            if self._keyring is None and bytes(payload[:len(MAGIC)]) == MAGIC:  # its frames are sealed, ours are not
                e = P.ProtocolError("its frames are sealed (it has a secret) and this side has none: set the same "
                                    "secret (KVBRIDGE_SECRET) on both sides")
                self._refusals[peer] = f"{e}"
            self._bad_frames.warn("bad_message", "from %s: %s", peer, e)
            if self.channel.endpoint:  # only a bound side answers (two sides answering each other would ping-pong)
                self._send(peer, P.TransferFailed(room=0, reason=f"malformed message: {e}", code="bad_message"))
            return
        self._peers_seen[peer] = time.monotonic()  # authenticated peers only: the map stays as small as the fleet
        self._on_message(peer, msg)

    def _evicted(self, name: str) -> None:
        self.metrics.evicted(name)  # self.metrics is looked up now: a map may be made before ControlSide.__init__

    def _on_disconnect(self, peer: str) -> None:
        """I/O thread: the control connection to ``peer`` closed (receivers only)."""

    def _on_message(self, peer: str, msg) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _on_tick(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        """Stop the control channel (rooms still open fail)."""
        self.channel.close()
