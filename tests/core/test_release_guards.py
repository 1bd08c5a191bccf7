"""The guards the release rule rests on, each on its own (the rows that exercise them
between processes are in tests/faults/test_release_rule.py).

- The resume guard: a sender asks, right before each piece, whether its decode peer has
  been silent past ``peer_timeout_s`` (this process was stopped, or the link was down):
  then the peer may have given the room up, and no further piece goes.
- The quiet check: a receiver whose sender failed without saying it is quiet keeps the
  room's blocks (quarantined); a quiet acknowledgement releases them, exactly once.
- A refused room has failed, with its reason, before the refusal goes out.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.common import protocol as P
from kvbridge.common.handoff import KVReceiver, KVSender, RoomState
from kvbridge.common.metrics import KVBridgeMetrics
from kvbridge.common.send_rooms import SendRoom
from kvbridge.common.settings import BridgeSettings
from kvbridge.common.metrics import HandoffRecord
from kvbridge.common.transport import MooncakeTransport
from kvbridge.layout.pools import allocate_pool
from prometheus_client import CollectorRegistry

CFG = BridgeSettings(peer_timeout_s=0.5, heartbeat_s=0.1, quiesce_s=0.2, deadline_s=30.0).handoff()


@pytest.fixture(scope="module")
def side():
    lay = allocate_pool("sglang", layers=2, total_heads=2, head_dim=16, dtype="bf16", tokens_per_block=16,
                        num_blocks=32, tp_size=1, tp_rank=0, seed=3)
    t = MooncakeTransport("127.0.0.1")
    made = []

    def make(cls):
        obj = cls(lay, t, config=CFG, metrics=KVBridgeMetrics(CollectorRegistry()))
        made.append(obj)
        return obj

    yield make
    for obj in made:
        obj.close()
    t.close()


def test_resume_guard_refuses_the_next_piece_to_a_peer_silent_past_the_timeout(side):
    sender = side(KVSender)
    r = SendRoom(1, time.monotonic() + 30, HandoffRecord(room=1, role="sender"), state=RoomState.TRANSFERRING)
    peer = "decode-peer"
    sender._peers_seen[peer] = time.monotonic()
    assert sender.pipeline.stop_reason(r, peer) is None
    sender._peers_seen[peer] = time.monotonic() - 2 * CFG.peer_timeout_s  # e.g. this process was stopped that long
    why = sender.pipeline.stop_reason(r, peer)
    assert why and "silent" in why and "no more writes" in why


def test_a_failed_sender_that_is_not_quiet_keeps_the_blocks(side):
    """A TransferFailed without ``quiet`` (the sender failed, but pieces of it may be in
    flight) fails the room and reports Failed, but the blocks stay quarantined until a
    quiet one comes; then they are released once."""
    recv = side(KVReceiver)
    released = []
    peer = "tcp://127.0.0.1:9"  # nothing listens: the receiver's own messages go nowhere
    recv.request(7, peer, np.arange(1, 5), 0, 64, release=lambda b, ok: released.append((b.tolist(), ok)))
    recv._on_message(peer, P.TransferFailed(room=7, reason="transport error", code="transfer", quiet=False))
    assert recv.wait(7, 5) is RoomState.FAILED
    time.sleep(3 * CFG.quiesce_s)
    assert recv.quarantined(7) and not released and not recv.settled(7)
    assert [q["room"] for q in recv.quarantine()] == [7]
    recv._on_message(peer, P.TransferFailed(room=7, reason="settled", code="settled", quiet=True))
    assert released == [([1, 2, 3, 4], False)] and recv.settled(7) and not recv.quarantine()
    recv._on_message(peer, P.TransferFailed(room=7, reason="settled", code="settled", quiet=True))
    assert len(released) == 1


def test_a_refused_room_has_failed_before_its_refusal_goes_out(side, monkeypatch):
    """A request the sender refuses (layouts that cannot pair) fails the room, with the
    reason, before the refusal leaves: the decode's answer to it (SGLang's abort notice, on
    another channel) then finds the room failed for that reason, not for the abort."""
    sender = side(KVSender)
    sender.add_room(11, [1, 2])
    other = allocate_pool("sglang", layers=2, total_heads=2, head_dim=32, dtype="bf16", tokens_per_block=16,
                          num_blocks=32, tp_size=1, tp_rank=0, seed=4)
    req = P.TransferRequest(room=11, model="", layout=P.LayoutDescription.of(other), block_ids=[1, 2], first_token=0,
                            token_start=0, token_stop=20, session="127.0.0.1:1", sent_at=time.time())
    seen = []

    def send(peer, msg):  # what the room looks like as each message leaves
        seen.append((type(msg).__name__, getattr(msg, "code", ""), sender.poll(11), sender.failure_reason(11)))

    monkeypatch.setattr(sender, "_send", send)
    sender._accept("decode-peer", req, time.monotonic())
    refusal = [s for s in seen if s[:2] == ("TransferFailed", "incompatible")]
    assert refusal, seen
    state, reason = refusal[0][2:]
    assert state is RoomState.FAILED and "head_dim" in reason, refusal
