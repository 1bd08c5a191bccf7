"""Wearing a prefill down: floods against a REAL ``KVSender`` (its own process, a secret
set) while an honest decode rank keeps talking to it.

- 100 frames over the size limit (ZMQ drops each connection before buffering one) and
  100 frames of 8 MiB under the deployment's key id with a wrong tag (each costs the
  sender one HMAC, then is refused unread);
- 4096 early rooms from a peer that holds the secret (the cap), then more, refused by name;
- a reader held on its first message while 800 MiB arrive on one connection: the bytes
  held here stay within the channel's per-connection byte cap.

Meanwhile a sealed ping goes out every 50 ms: its round trip stays under the peer timeout
(a decode rank would otherwise give the prefill up), the sender's resident memory stays
bounded, each refusal is counted, the log stays short, and the next honest handoff is
byte-exact.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import zmq

from kvbridge.common import protocol as P
from kvbridge.common.auth import OVERHEAD
from kvbridge.common.sender import MAX_EARLY_ROOMS
from tests.helpers import hostile_peers
from tests.hostile.test_hostile_input import RING, SECRET, Peer, _request_dict, _sealed, _spec, from_prefill, to_prefill

pytestmark = [pytest.mark.timeout(300)]

PEER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def pre():
    p = Peer(hostile_peers.prefill_main, _spec("sglang", 16, 81, blocks=256),
             {"secret": SECRET, "peer_timeout_s": PEER_TIMEOUT_S})
    yield p
    p.stop()


@pytest.fixture(scope="module")
def dec():
    p = Peer(hostile_peers.decode_main, _spec("trtllm", 32, 82), {"secret": SECRET, "peer_timeout_s": PEER_TIMEOUT_S})
    yield p
    p.stop()


class Pinger(threading.Thread):
    """A peer holding the secret, pinging ``endpoint`` every 50 ms; keeps the round trips."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint, self.rtts, self.lost = endpoint, [], 0
        self._halt = threading.Event()

    def run(self):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        for n in itertools.count(1):
            if self._halt.is_set():
                break
            t0 = time.monotonic()
            sock.send(P.pack(P.Heartbeat(room=n, sender="pinger"), RING, to_prefill(self.endpoint)))
            while True:
                if not sock.poll(int(PEER_TIMEOUT_S * 2000)):
                    self.lost += 1
                    break
                m = P.unpack(sock.recv(), RING, from_prefill(self.endpoint))
                if isinstance(m, P.Heartbeat) and m.room == n:
                    self.rtts.append(time.monotonic() - t0)
                    break
            time.sleep(0.05)
        sock.close(0)

    def stop(self):
        self._halt.set()
        self.join(30)


def _flood(endpoint: str, frames, per_socket: int = 1, linger_ms: int = 0) -> None:
    """Send ``frames``, a fresh connection every ``per_socket`` (ZMQ drops one that sent too big a frame)."""
    ctx, sock = zmq.Context.instance(), None
    for i, f in enumerate(frames):
        if i % per_socket == 0:
            if sock is not None:
                sock.close()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, linger_ms)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.connect(endpoint)
        sock.send(f, copy=False)
    sock.close()  # with its linger: what is still queued goes out first


def _honest_handoff(pre, dec, room: int) -> None:
    src = pre.call("register", room, 64)[1]
    pre.call("compute", room)
    out = dec.call("pull_verify", room, pre.ready[1], 64, pre.spec, src)[1]
    assert out["state"] == "SUCCESS" and out["bytes_ok"] and out["outside_changed"] == 0, out


def test_oversized_and_badly_tagged_frames(pre, dec):
    ep = pre.ready[1]
    rss0 = pre.call("rss")[1]
    refused0 = pre.call("refused")[1].get("control/bad_tag", 0)
    ping = Pinger(ep)
    ping.start()
    try:
        over = b"\x00" * (P.MAX_MESSAGE_BYTES + (1 << 20))
        _flood(ep, [over] * 100, linger_ms=2000)  # each over the limit and sent whole: its connection is dropped, nothing buffered
        genuine = RING.seal(b"\x00" * (8 << 20), to_prefill(ep))
        bad = genuine[:OVERHEAD - 1] + bytes([genuine[OVERHEAD - 1] ^ 1]) + genuine[OVERHEAD:]
        _flood(ep, [bad] * 100, per_socket=100, linger_ms=60_000)  # every one delivered
        deadline = time.monotonic() + 60
        while pre.call("refused")[1].get("control/bad_tag", 0) < refused0 + 100 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        ping.stop()
    assert pre.call("refused")[1].get("control/bad_tag", 0) == refused0 + 100
    assert ping.lost == 0 and ping.rtts and max(ping.rtts) < PEER_TIMEOUT_S, (ping.lost, max(ping.rtts, default=None))
    rss1 = pre.call("rss")[1]
    assert rss1 - rss0 < 256 << 20, f"the sender's RSS grew {(rss1 - rss0) >> 20} MiB"
    logs = [t for _, t in pre.call("logs")[1]]
    assert len(logs) < 40, logs[:40]
    _honest_handoff(pre, dec, 7001)
    print(f"ping rtt over the flood: median {sorted(ping.rtts)[len(ping.rtts) // 2] * 1e3:.1f} ms, "
          f"max {max(ping.rtts) * 1e3:.1f} ms ({len(ping.rtts)} pings); RSS +{(rss1 - rss0) >> 20} MiB")


def test_early_rooms_flood_is_capped(pre, dec):
    ep = pre.ready[1]
    session, layout = dec.ready[1], dec.ready[3]
    ping = Pinger(ep)
    ping.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    try:
        n_flood = MAX_EARLY_ROOMS + 64
        for i in range(n_flood):
            sock.send(_sealed(_request_dict(1_000_000 + i, session, layout, [1, 2], 32), ep))
        refused, end = 0, time.monotonic() + 60
        while refused < 64 and time.monotonic() < end:
            if sock.poll(200):
                m = P.unpack(sock.recv(), RING, from_prefill(ep))
                refused += isinstance(m, P.TransferFailed) and "requests wait" in m.reason
        _honest_handoff(pre, dec, 7002)  # a registered room is served whatever waits
    finally:
        ping.stop()
        sock.close(0)
    assert refused == 64
    assert ping.lost == 0 and max(ping.rtts) < PEER_TIMEOUT_S, (ping.lost, max(ping.rtts, default=None))
    print(f"ping rtt over {n_flood} early rooms: max {max(ping.rtts) * 1e3:.1f} ms ({len(ping.rtts)} pings)")


_FLOODER = r"""
import sys, time, zmq
ep, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.SNDHWM, 100000)
s.setsockopt(zmq.LINGER, 60000)
s.connect(ep)
frame = b"\x00" * size
for _ in range(n):
    s.send(frame)
print("queued", flush=True)
time.sleep(600)
"""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_stalled_reader_holds_a_bounded_number_of_bytes_per_connection():
    """The window forced: the channel's handler is held on its first message while a
    stranger (its own process) queues 100 frames of 8 MiB on one connection. What this
    process holds meanwhile stays within the byte cap (queue_bytes: a few frames), not
    the 800 MiB sent; the rest waits on the stranger's side. Let go, every frame is read,
    in order, and a message sent afterwards arrives."""
    import subprocess
    import sys

    from kvbridge.common.control import ControlChannel

    n, size, cap = 100, 8 << 20, 64 << 20
    hold, first = threading.Event(), threading.Event()
    got: list[int] = []

    def on_message(peer, payload):
        got.append(len(payload))
        first.set()
        hold.wait(120)

    chan = ControlChannel(on_message, bind_host="127.0.0.1", name="bytecap-test", queue_bytes=cap)
    proc = subprocess.Popen([sys.executable, "-c", _FLOODER, chan.endpoint, str(n), str(size)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert first.wait(60), "the first frame never arrived"
        before = _rss()
        assert proc.stdout.readline().strip() == "queued"
        time.sleep(2.0)  # ample for ZMQ to read all it is allowed to
        held = _rss() - before
        frames_held = max(2, cap // ((16 << 20) + 4096)) + 1  # the queue (RCVHWM, by the largest frame) and the one read
        print(f"handler held: this process grew {held / 2**20:.1f} MiB while {n} x {size >> 20} MiB were sent "
              f"(cap {cap >> 20} MiB: {frames_held} frames)")
        assert held <= (frames_held + 2) * size, f"{held / 2**20:.0f} MiB held for one connection"
        hold.set()
        deadline = time.monotonic() + 120
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == [size] * n, (len(got), set(got))
        with zmq.Context.instance().socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(chan.endpoint)
            s.send(b"after")
            deadline = time.monotonic() + 10
            while got[-1] != 5 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert got[-1] == 5
    finally:
        hold.set()
        proc.kill()
        proc.wait()
        chan.close()
