"""Moving one request's KV (one "room") between a prefill rank and a decode rank: the
public face of the transfer core's state machines.

Decode side (``KVReceiver``, ``kvbridge.common.receiver``): the engine hands it a room's
blocks; it asks every prefill rank holding part of the request for its tokens and waits
for each one's ``TransferDone``. Prefill side (``KVSender``, ``kvbridge.common.sender``):
takes the request, checks it, and as each prefill chunk's KV is ready plans and writes
it through the Mooncake transport (``kvbridge.common.send_pipeline``), gathering into a
staging ring overlapped with the writes when the layouts differ.

Room states are ordered like SGLang's ``KVPoll`` (Failed < Bootstrapping < Waiting <
Transferring < Success), so the minimum over ranks is the request's state. Every room has
a deadline; both sides heartbeat; ``abort`` works from either side. Each side's blocks
for a room are released exactly once (``BlockLease``). Settings: ``HandoffConfig``.
"""

from .receiver import KVReceiver
from .rooms import TERMINAL, HandoffFailed, PeerState, RoomState, default_metrics
from .settings import HandoffConfig
from .sender import KVSender

__all__ = ["RoomState", "PeerState", "TERMINAL", "KVSender", "KVReceiver", "HandoffConfig", "HandoffFailed",
           "default_metrics"]
