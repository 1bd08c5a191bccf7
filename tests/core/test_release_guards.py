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

import threading
import time

import numpy as np
import pytest

from kvbridge.common import protocol as P
from kvbridge.common.blocks import BlockLease
from kvbridge.common.handoff import KVReceiver, KVSender, RoomState
from kvbridge.common.metrics import KVBridgeMetrics
from kvbridge.common.send_rooms import SendRoom
from kvbridge.common.settings import BridgeSettings
from kvbridge.common.metrics import HandoffRecord
from kvbridge.common.transport import MooncakeTransport
from kvbridge.layout.pools import allocate_pool
from prometheus_client import CollectorRegistry
from tests.helpers.kvhelpers import wait_until

CFG = BridgeSettings(peer_timeout_s=0.5, heartbeat_s=0.1, quiesce_s=0.2, deadline_s=30.0).handoff()
CFG_VERIFY = BridgeSettings(peer_timeout_s=0.5, heartbeat_s=0.1, quiesce_s=0.2, deadline_s=30.0, integrity="on").handoff()


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

    make.layout, make.transport, make.made = lay, t, made
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
    attempt = recv._rooms[7].attempt  # the request's: the sender's answers echo it
    recv._on_message(peer, P.TransferFailed(room=7, reason="transport error", code="transfer", quiet=False,
                                            attempt=attempt))
    assert recv.wait(7, 5) is RoomState.FAILED
    time.sleep(3 * CFG.quiesce_s)
    assert recv.quarantined(7) and not released and not recv.settled(7)
    assert [q["room"] for q in recv.quarantine()] == [7]
    recv._on_message(peer, P.TransferFailed(room=7, reason="settled", code="settled", quiet=True, attempt=attempt))
    assert released == [([1, 2, 3, 4], False)] and recv.settled(7) and not recv.quarantine()
    recv._on_message(peer, P.TransferFailed(room=7, reason="settled", code="settled", quiet=True, attempt=attempt))
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


def test_a_quiet_answer_during_our_scatter_or_check_keeps_the_blocks_until_it_ends(side, monkeypatch):
    """A sender's Done hands the room's content to this side's scatter or content check
    (the peer is *scattering*); a quiet TransferFailed or an Abort from that sender while
    it runs (a sender failing the room for another decode rank tells every one) fails the
    room, but its blocks and staging stay with it until the scatter or check has ended."""
    recv = KVReceiver(side.layout, side.transport, config=CFG_VERIFY, metrics=KVBridgeMetrics(CollectorRegistry()))
    try:
        inside, let_go = threading.Event(), threading.Event()

        def held_check(r, peer, msg):  # the content check, held open: the window is forced
            inside.set()
            assert let_go.wait(10)
            return ""

        monkeypatch.setattr(recv, "_verify", held_check)
        for room, last in ((21, dict(cls=P.TransferFailed, reason="failed for another rank", code="transfer", quiet=True)),
                           (22, dict(cls=P.Abort, reason="aborted by prefill"))):
            inside.clear(), let_go.clear()
            released = []
            peer = "tcp://127.0.0.1:9"
            recv.request(room, peer, np.arange(1, 5), 0, 64, release=lambda b, ok: released.append(ok))
            nl = side.layout.num_layers
            need, attempt = recv._rooms[room].need_bytes, recv._rooms[room].attempt
            recv._on_message(peer, P.TransferDone(room=room, bytes=need, segments=1, plan="direct", seconds=0.1,
                                                  layer_bytes=[need // nl] * nl, attempt=attempt))
            assert inside.wait(10)
            last = dict(last)
            recv._on_message(peer, last.pop("cls")(room=room, attempt=attempt, **last))
            if "quiet" not in last:  # an Abort: a quiet answer to ours follows it
                recv._on_message(peer, P.TransferFailed(room=room, reason="settled", code="settled", quiet=True,
                                                        attempt=attempt))
            assert recv.wait(room, 5) is RoomState.FAILED
            time.sleep(3 * CFG.quiesce_s)
            assert not released, f"room {room}: blocks released while our check of what landed still ran"
            let_go.set()
            wait_until(lambda: released, 5, what=f"room {room}'s blocks released once the check ended")
            time.sleep(0.2)
            assert released == [False]
    finally:
        let_go.set()
        recv.close()


def test_an_answer_to_the_probe_after_a_closed_connection_proves_the_process_lives(side):
    """A prefill's control connection closed (a reset; the process lives and ZMQ connects
    again): the receiver probes it, and the same incarnation answering that probe keeps
    the room's peer alive; only silence past ``gone_drain_s`` is taken as the process gone."""
    cfg = BridgeSettings(peer_timeout_s=30.0, heartbeat_s=0.1, deadline_s=30.0).handoff()  # only the close counts here
    recv = KVReceiver(side.layout, side.transport, config=cfg, metrics=KVBridgeMetrics(CollectorRegistry()))
    side.made.append(recv)
    peer = "tcp://127.0.0.1:9"
    recv.request(31, peer, np.arange(1, 5), 0, 64)
    recv._on_message(peer, P.Heartbeat(room=1, sender=peer, incarnation="prefill-a"))
    recv._on_disconnect(peer)
    probe = recv._closed_at[peer][1]
    recv._on_message(peer, P.Heartbeat(room=probe, sender=peer, incarnation="prefill-a"))
    time.sleep(cfg.gone_drain_s + 0.5)
    assert recv.poll(31) is not RoomState.FAILED, recv.failure_reason(31)
    recv._on_disconnect(peer)  # closed again, and this time nobody answers: gone
    assert recv.wait(31, cfg.gone_drain_s + 5) is RoomState.FAILED
    assert "process gone" in recv.failure_reason(31)


def test_a_failing_send_worker_holds_its_room_until_the_room_has_failed(side, monkeypatch):
    """A send worker whose write failed fails the room while it still holds it: no second
    worker can start on the room in between (its pieces would be in the transport when the
    first worker's settle tells the decode side the room is quiet)."""
    from kvbridge.common.writes import TransportError

    sender = side(KVSender)
    released = []
    r = SendRoom(41, time.monotonic() + 30, HandoffRecord(room=41, role="sender"), state=RoomState.TRANSFERRING,
                 lease=BlockLease(41, [1, 2], lambda b, ok: released.append(ok)))
    sender._rooms[41] = r
    drains, held = [], []
    monkeypatch.setattr(sender.pipeline, "_prestage", lambda r: None)
    monkeypatch.setattr(sender.pipeline, "next_work", lambda r: (None, None, 1))

    def failing_write(r, target, chunk, ring):
        drains.append(threading.current_thread().name)
        raise TransportError("piece failed (test)")

    monkeypatch.setattr(sender.pipeline, "_send_one", failing_write)
    fail = sender.fail

    def failing(room, reason, code):  # a layer-wise send_chunk kicking the room at this moment
        held.append(r.busy)
        sender._kick(r)
        fail(room, reason, code)

    monkeypatch.setattr(sender, "fail", failing)
    with sender.lock:
        r.busy = True
    sender.pipeline.drain(r)
    wait_until(lambda: r.settled, 10, what="the failed room settled once its worker let go")
    assert held == [True] and len(drains) == 1, (held, drains)
    assert r.state is RoomState.FAILED and not r.busy and released == [False] and r.settled


def test_a_late_answer_to_an_earlier_request_under_the_same_room_id_changes_nothing(side):
    """Room ids come back (an engine reuses them, a client retries with its own). The quiet
    answer to an Abort of the room's earlier request, arriving once the room was asked for
    again, is about that request: it neither fails the new one nor counts as proof that
    its sender is quiet, so the new room's blocks stay with it until its own sender says so."""
    recv = side(KVReceiver)
    peer = "tcp://127.0.0.1:9"
    released = []
    recv.request(51, peer, np.arange(1, 5), 0, 64, release=lambda b, ok: released.append(("first", ok)))
    first = recv._rooms[51].attempt
    recv.abort(51, "the client went away")
    recv._on_message(peer, P.TransferFailed(room=51, reason="settled", code="settled", quiet=True, attempt=first))
    wait_until(lambda: released, 5, what="the first request's blocks released")
    recv.forget(51)
    recv.request(51, peer, np.arange(5, 9), 0, 64, release=lambda b, ok: released.append(("second", ok)))
    second = recv._rooms[51].attempt
    assert second not in (0, first)
    # the sender's answer to the first request's Abort, asked again a heartbeat later
    recv._on_message(peer, P.TransferFailed(room=51, reason="aborted by decode", code="aborted", quiet=True,
                                            attempt=first))
    time.sleep(0.3)
    assert recv.poll(51) is not RoomState.FAILED, recv.failure_reason(51)
    recv.abort(51, "and this one")
    assert recv.wait(51, 5) is RoomState.FAILED
    time.sleep(3 * CFG.quiesce_s)
    assert released == [("first", False)] and recv.quarantined(51)
    recv._on_message(peer, P.TransferFailed(room=51, reason="settled", code="settled", quiet=True, attempt=first))
    assert released == [("first", False)], "a stale answer released the new request's blocks"
    recv._on_message(peer, P.TransferFailed(room=51, reason="settled", code="settled", quiet=True, attempt=second))
    assert released == [("first", False), ("second", False)]


def test_a_scatter_writes_only_the_tokens_the_room_asked_for(side):
    """A staged chunk naming tokens the decode already holds (a prefix, whose blocks other
    requests may share) or past the room's last one fails the room by name: this side's
    own scatter writes only tokens ``[start, stop)`` of the request, whatever a sender's
    Done says."""
    cfg = BridgeSettings(peer_timeout_s=30.0, heartbeat_s=0.1, quiesce_s=0.2, deadline_s=30.0,
                         recv_staging_bytes=1 << 20).handoff(receiver=True)
    recv = KVReceiver(side.layout, side.transport, config=cfg, metrics=KVBridgeMetrics(CollectorRegistry()))
    side.made.append(recv)
    peer = "tcp://127.0.0.1:9"
    desc = P.LayoutDescription.of(side.layout)
    for room, (start, stop) in ((61, (0, 48)), (62, (16, 80))):
        recv.request(room, peer, np.arange(1, 5), 16, 64)  # tokens [0, 16) already held here
        r = recv._rooms[room]
        chunk = P.StagedChunk(first_token=0, start=start, stop=stop, offset=0, blocks=[5, 6, 7, 8, 9])
        recv._on_message(peer, P.TransferDone(room=room, bytes=r.need_bytes, segments=1, plan="staged_recv", seconds=0.1,
                                              staged=[chunk], src_layout=desc, attempt=r.attempt,
                                              layer_bytes=[r.need_bytes // side.layout.num_layers] * side.layout.num_layers))
        assert recv.wait(room, 5) is RoomState.FAILED
        assert f"tokens [{start}, {stop}) outside the tokens [16, 64)" in recv.failure_reason(room), recv.failure_reason(room)
