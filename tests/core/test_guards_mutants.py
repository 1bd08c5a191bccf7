"""Guarantees that no other test isolates, each checked on its own (``make mutants``
removes each one and expects these tests to fail; docs/testing.md).

- A room's blocks go back to their engine exactly once, however many paths try at once.
- A decode asks a sender it has no proof of quiet from to stop again every heartbeat (a
  sender that missed the first abort hears a later one), until the quiet answer comes.
- A layer-wise TensorRT-LLM prefill on CUDA: the room's end (its ``Send`` order) is handed
  to the sender only after the layers queued before it, which wait for their device
  event (gates a test opens stand in for ``torch.cuda.Event``: no GPU here).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from kvbridge.adapters.trtllm import bus as B
from kvbridge.adapters.trtllm.config import BridgeConfig
from kvbridge.adapters.trtllm.worker import KVBridgeConnectorWorker, _LayerSend, _Saving
from kvbridge.common import protocol as P
from kvbridge.common.blocks import BlockLease
from kvbridge.common.handoff import KVReceiver, RoomState
from kvbridge.common.metrics import KVBridgeMetrics
from kvbridge.common.settings import BridgeSettings
from kvbridge.common.transport import MooncakeTransport
from kvbridge.layout.pools import allocate_pool


def test_blocks_go_back_once_whoever_releases_them():
    calls, counted = [], []
    lease = BlockLease(3, [5, 6, 7], lambda blocks, ok: calls.append((blocks.tolist(), ok)), counted.append)
    start = threading.Barrier(8)
    won = []

    def release(ok):
        start.wait()
        won.append(lease.release(ok))

    threads = [threading.Thread(target=release, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1 and won.count(False) == 7
    assert len(calls) == 1 and calls[0][0] == [5, 6, 7]
    assert counted == [3, -3] and lease.released
    assert lease.release(True) is False and len(calls) == 1


def test_a_sender_not_proven_quiet_is_asked_to_stop_every_heartbeat():
    """A prefill (a bare socket here) fails the room without saying it is quiet, then stays
    silent: the decode quarantines the blocks and sends it an Abort for the room every
    ``heartbeat_s``, not just once; its quiet answer releases the blocks, once."""
    lay = allocate_pool("sglang", layers=2, total_heads=2, head_dim=16, dtype="bf16", tokens_per_block=16,
                        num_blocks=32, tp_size=1, tp_rank=0, seed=3)
    transport = MooncakeTransport("127.0.0.1")
    cfg = BridgeSettings(heartbeat_s=0.1, quiesce_s=0.2, peer_timeout_s=30.0).handoff(receiver=True)
    recv = KVReceiver(lay, transport, config=cfg,
                      metrics=KVBridgeMetrics(CollectorRegistry()))
    prefill = zmq.Context.instance().socket(zmq.ROUTER)
    prefill.setsockopt(zmq.LINGER, 0)
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    released = []

    def next_message(timeout_s):
        if not prefill.poll(int(timeout_s * 1000)):
            return None, None
        ident, payload = prefill.recv_multipart()
        return ident, P.decode(payload)

    try:
        recv.request(8, f"tcp://127.0.0.1:{port}", np.arange(1, 5), 0, 64,
                     release=lambda b, ok: released.append((b.tolist(), ok)))
        ident, msg = next_message(10)
        assert isinstance(msg, P.TransferRequest) and msg.room == 8, msg
        attempt = msg.attempt  # the request's: every answer about it carries it
        prefill.send_multipart([ident, P.encode(P.TransferFailed(room=8, reason="write failed", code="transfer",
                                                                 quiet=False, attempt=attempt))])
        aborts, end = [], time.monotonic() + 1.5  # 15 heartbeats
        while time.monotonic() < end:
            _, msg = next_message(max(0.0, end - time.monotonic()))
            if isinstance(msg, P.Abort) and msg.room == 8:
                aborts.append(time.monotonic())
        assert recv.poll(8) is RoomState.FAILED and recv.quarantined(8) and not released
        assert len(aborts) >= 5, f"the sender was asked to stop {len(aborts)} time(s) in 15 heartbeats"
        prefill.send_multipart([ident, P.encode(P.TransferFailed(room=8, reason="settled", code="settled", quiet=True,
                                                                 attempt=attempt))])
        end = time.monotonic() + 5
        while not released and time.monotonic() < end:
            time.sleep(0.01)
        assert released == [([1, 2, 3, 4], False)] and recv.settled(8)
    finally:
        prefill.close(0)
        recv.close()
        transport.close()


class Gate:
    """A device event stand-in: ``synchronize()`` returns once the test opens it."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "a gate never opened"


class RecordingSender:
    """The calls the worker makes into its ``KVSender``, in order."""

    def __init__(self):
        self.calls = []
        self.seen = threading.Event()

    def send_chunk(self, room, blocks, start, stop, *, last, first_token=0, aux=None, layers=None):
        self.calls.append(("send_chunk", room, start, stop, last, layers))

    def finish(self, room, aux=None):
        self.calls.append(("finish", room, aux))
        self.seen.set()


def test_trtllm_send_waits_for_layers_queued_on_the_device():
    w = KVBridgeConnectorWorker(None, config=BridgeConfig())
    w.layout = SimpleNamespace(num_layers=4, device=None)
    w.sender = RecordingSender()
    s = w._sends[1] = _Saving(1, 11, opened=True)
    blocks = np.array([3, 4], dtype=np.int64)
    gate = Gate()
    try:
        # one CUDA forward computes tokens [0, 64) of request 1: layers 0-1 after one event, 2-3 after another
        w._forward = [_LayerSend(s, blocks, 0, 64)]
        w._send_layers(2, gate)
        w._send_layers(4, gate)
        w._forward = []
        # the prefill half finished (rank 0's Send): every layer was streamed, so it ends the room
        w._send_in_order(B.Send(req=1, room=11, blocks=[3, 4], stop=64, first_token=9, layered_to=64))
        assert w.sender.calls == [], "a sender call ran before its layers' device event completed"
        gate.done.set()
        assert w.sender.seen.wait(10), "the room's end never reached the sender"
        assert w.sender.calls == [("send_chunk", 11, 0, 64, False, (0, 2)), ("send_chunk", 11, 0, 64, False, (2, 4)),
                                  ("finish", 11, {"output_ids": [9]})]
        assert s.ended_by == "finish"
    finally:
        gate.done.set()
        w._dispatch.close()
