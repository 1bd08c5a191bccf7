"""The control channel: ZMQ ROUTER/DEALER sockets owned by one I/O thread.

The prefill side binds a ROUTER (its endpoint is what discovery hands out, e.g. through
SGLang's bootstrap server); each decode side connects a DEALER per prefill endpoint.
Messages are kvbridge protocol frames (``protocol.encode``), one frame each: a peer that
sends more frames (which could name another peer's routing id) or a frame larger than
``max_message_bytes`` (ZMQ drops its connection before buffering it) is refused, so a
hostile peer can neither speak for another one nor make us buffer gigabytes. Any thread may ``send``;
only the I/O thread touches sockets (others wake it through an inproc pair). Received
messages go to ``on_message(peer, payload)`` on the I/O thread, and ``on_tick()`` runs
there at least every ``tick_s`` for deadlines and heartbeats, each time before the
messages that arrived since the last one are read (and after queued sends are flushed).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

import zmq

__all__ = ["ControlChannel"]

log = logging.getLogger(__name__)
_ids = itertools.count()


class ControlChannel:
    """One process side of the control plane: an optional bound ROUTER plus DEALERs."""

    def __init__(
        self,
        on_message: Callable[[str, bytes], None],
        on_tick: Callable[[], None] | None = None,
        *,
        bind_host: str | None = None,
        port: int = 0,
        tick_s: float = 0.05,
        name: str = "kvbridge-control",
        max_message_bytes: int = 16 << 20,
    ):
        self._ctx = zmq.Context.instance()
        self._on_message = on_message
        self._on_tick = on_tick or (lambda: None)
        self._tick_ms = max(1, int(tick_s * 1000))
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://kvbridge-wake-{id(self)}-{next(_ids)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._router = None
        self.endpoint = ""
        # a frame this large (plus msgpack slack) makes ZMQ drop the sending peer's connection
        self._max_frame = int(max_message_bytes) + 4096
        self.refused_frames = 0  # messages dropped for having the wrong frame count
        if bind_host is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if port:
                self._router.bind(f"tcp://{bind_host}:{port}")
            else:
                self._router.bind(f"tcp://{bind_host}:*")
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.Socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------
    def send(self, peer: str, payload: bytes, *, wait_s: float = 0.0) -> None:
        """Queue ``payload`` for ``peer``: a ROUTER identity (hex) or a ``tcp://`` endpoint.
        With ``wait_s`` > 0, a thread other than the I/O thread blocks until the I/O thread
        has handed the message to ZMQ (at most ``wait_s``): a latency-critical message then
        leaves before the caller's further work, which would otherwise hold the GIL first."""
        sent = threading.Event() if wait_s > 0 and threading.get_ident() != self._thread.ident else None
        self._out.put((peer, payload, sent))
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        if sent is not None:
            sent.wait(wait_s)

    def close(self) -> None:
        """Stop the I/O thread and close every socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_tx.close(0)

    # -- I/O thread ---------------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket:
        s = self._dealers.get(endpoint)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 0)
            s.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            s.connect(endpoint)
            self._dealers[endpoint] = s
            self._poller.register(s, zmq.POLLIN)
        return s

    def _flush(self) -> None:
        while True:
            try:
                peer, payload, sent = self._out.get_nowait()
            except queue.Empty:
                return
            try:
                if peer.startswith("tcp://"):
                    self._dealer(peer).send(payload, zmq.NOBLOCK)
                elif self._router is not None:
                    self._router.send_multipart([bytes.fromhex(peer), payload], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # peer gone or queue full: deadlines handle the rest
                log.warning("control message to %s dropped: %s", peer, e)
            finally:
                if sent is not None:
                    sent.set()

    def _loop(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(self._poller.poll(self._tick_ms))
                if self._wake_rx in events:
                    for _ in self._waiting(self._wake_rx):
                        pass
                self._flush()  # what other threads queued leaves first (a Done is on someone's critical path)
                # deadlines and silences next, on what was seen before this poll: a process
                # resuming from a stall (SIGSTOP, a long pause) judges its peers by that, not
                # by the frames they queued while it was stopped
                try:
                    self._on_tick()
                except Exception:
                    log.exception("control tick failed")
                self._flush()  # what the tick queued
                if self._router is not None and self._router in events:
                    for frames in self._waiting(self._router):
                        if len(frames) != 2:  # [routing id, payload]; more frames could name another peer's id
                            self.refused_frames += 1
                            log.warning("control message from %s refused: %d frames, expected 1",
                                        frames[0].hex(), len(frames) - 1)
                            continue
                        self._dispatch(frames[0].hex(), frames[1])
                for ep, s in list(self._dealers.items()):
                    if s in events:
                        for frames in self._waiting(s):
                            if len(frames) != 1:
                                self.refused_frames += 1
                                log.warning("control message from %s refused: %d frames, expected 1", ep, len(frames))
                                continue
                            self._dispatch(ep, frames[0])
        finally:
            for s in self._dealers.values():
                s.close(0)
            if self._router is not None:
                self._router.close(0)
            self._wake_rx.close(0)

    @staticmethod
    def _waiting(sock: zmq.Socket):
        """The messages waiting on ``sock``, each as its list of frames, until none is left
        (asked through ZMQ_EVENTS: no exception raised per wake-up on the way out)."""
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                yield sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _dispatch(self, peer: str, payload: bytes) -> None:
        try:
            self._on_message(peer, payload)
        except Exception:
            log.exception("control message from %s failed", peer)
