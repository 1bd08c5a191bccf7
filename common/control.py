"""The control channel: ZMQ ROUTER/DEALER sockets, read by one I/O thread.

The prefill side binds a ROUTER (its endpoint is what discovery hands out, e.g. through
SGLang's bootstrap server); each decode side connects a DEALER per prefill endpoint.
Messages are kvbridge protocol frames (``protocol.encode``), one frame each: a peer that
sends more frames (which could name another peer's routing id) or a frame larger than
``max_message_bytes`` (ZMQ drops its connection before buffering it) is refused, so a
hostile peer can neither speak for another one nor make us buffer gigabytes. What one
connection can make this process hold is capped in bytes: its incoming queue holds
``queue_bytes // (max_message_bytes + 4096)`` messages (at least 2; ZMQ's RCVHWM), so at
most that many frames of the largest size plus the one being read wait here; past it ZMQ
stops reading that connection and the bytes wait in the peer's process and the kernel's
socket buffers (TCP flow control), never here. The number of connections is bounded by
the process's file descriptors, not here.

Any thread may ``send``: at once, on the caller's thread, when the peer's socket exists
(every use of a socket holds one lock, which is what ZMQ asks of a socket shared between
threads), else through the I/O thread, which connects the DEALER first; a peer's
messages keep their order either way. The I/O thread waits on the sockets' ZMQ_FD (not
on the sockets, which other threads may be using), reads them, hands each message to
``on_message(peer, payload)`` and runs ``on_tick()`` at least every ``tick_s`` for
deadlines and heartbeats, each time before the messages that arrived since the last one
are read (and after queued sends are flushed).

With ``on_disconnect``, each DEALER is watched (a ZMQ socket monitor): when its TCP
connection to a prefill endpoint closes (the process there exited or was killed, so the
kernel closed its sockets), ``on_disconnect(endpoint)`` runs on the I/O thread. A
stopped process or a partition closes nothing, so neither is reported. ``reached(ep)``
says whether a connection to ``ep`` was ever made (until then everything sent to it
waits in this process), and ``discard(ep)`` drops that DEALER with what waits in it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

import zmq

from .limits import LogLimiter

__all__ = ["ControlChannel"]

log = logging.getLogger(__name__)
_ids = itertools.count()


class ControlChannel:
    """One process side of the control plane: an optional bound ROUTER plus DEALERs.
    ``hwm``: messages queued per peer for sending before a send to it is dropped;
    ``queue_bytes``: bytes of one connection's incoming messages held here at most
    (module docstring)."""

    def __init__(
        self,
        on_message: Callable[[str, bytes], None],
        on_tick: Callable[[], None] | None = None,
        *,
        on_disconnect: Callable[[str], None] | None = None,
        bind_host: str | None = None,
        port: int = 0,
        tick_s: float = 0.05,
        name: str = "kvbridge-control",
        max_message_bytes: int = 16 << 20,
        hwm: int = 100_000,
        queue_bytes: int = 64 << 20,
    ):
        self._ctx = zmq.Context.instance()
        self._on_message = on_message
        self._on_tick = on_tick or (lambda: None)
        self._on_disconnect = on_disconnect
        self._monitors: dict[zmq.Socket, str] = {}  # the I/O thread's: DEALER monitor -> its endpoint
        self._reached: set[str] = set()  # endpoints a DEALER connection was ever made to (I/O thread writes)
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
        self._bad = LogLimiter(log, f"{name}: control messages refused")
        # ZMQ's default 1000-message queues drop a burst when the peer's reader is starved of
        # CPU (a non-blocking send fails with EAGAIN): control messages are small, so allow
        # deep queues and leave lost peers to the deadlines
        self._hwm = int(hwm)
        # incoming messages queued per connection: a byte cap over frames of the largest size
        self._rcv_hwm = max(2, int(queue_bytes) // self._max_frame)
        if bind_host is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._router.setsockopt(zmq.SNDHWM, self._hwm)
            self._router.setsockopt(zmq.RCVHWM, self._rcv_hwm)
            if port:
                self._router.bind(f"tcp://{bind_host}:{port}")
            else:
                self._router.bind(f"tcp://{bind_host}:*")
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.Socket] = {}
        self._sock_lock = threading.Lock()  # held for every use of the router and the dealers
        self._closed = False
        self._poller = zmq.Poller()  # the I/O thread's; it alone registers and polls
        self._poller.register(self._wake_rx, zmq.POLLIN)
        if self._router is not None:
            self._poller.register(self._router.getsockopt(zmq.FD), zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------
    def send(self, peer: str, payload: bytes) -> None:
        """Send ``payload`` to ``peer``: a ROUTER identity (hex) or a ``tcp://`` endpoint.
        Handed to ZMQ before this returns when the peer's socket exists (the usual case: a
        reply, or a request to a prefill rank asked before); a first message to an endpoint
        goes through the I/O thread, which connects to it."""
        wake = False
        with self._sock_lock:
            if self._closed:
                log.debug("control message to %s dropped: the channel is closed", peer)
                return
            if peer.startswith("tcp://"):
                sock = self._dealers.get(peer)
                if sock is None:  # the I/O thread connects it, then sends everything queued, in order
                    self._out.put((peer, payload))
                    wake = True
                else:
                    self._send_on(sock, peer, payload)
            elif self._router is not None:
                sock = self._router
                self._send_on(sock, peer, payload)
            else:
                return
            # a send may take the edge of the socket's ZMQ_FD that the I/O thread waits on
            wake = wake or bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        if wake:
            self._wake()

    def pending(self) -> bool:
        """Whether a message waits to be read on the bound (ROUTER) socket; any thread, e.g.
        a worker deciding whether to stop optional work and let it be handled."""
        if self._router is None:
            return False
        with self._sock_lock:
            waiting = not self._closed and bool(self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        if waiting:  # asking took the ZMQ_FD edge the I/O thread may be waiting on
            self._wake()
        return waiting

    def close(self) -> None:
        """Stop the I/O thread and close every socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_tx.close(0)

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closed, or plenty of wake-ups already queued
                pass

    def _send_on(self, sock: zmq.Socket, peer: str, payload: bytes) -> None:
        """Hand one message to ZMQ (the socket lock held)."""
        try:
            if sock is self._router:
                sock.send_multipart([bytes.fromhex(peer), payload], zmq.NOBLOCK)
            else:
                sock.send(payload, zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as e:  # peer gone, queue full, bad id: deadlines handle the rest
            log.warning("control message to %s dropped: %s", peer, e)

    # -- I/O thread ---------------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket:
        s = self._dealers.get(endpoint)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 0)
            s.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            s.setsockopt(zmq.SNDHWM, self._hwm)
            s.setsockopt(zmq.RCVHWM, self._rcv_hwm)
            if self._on_disconnect is not None:  # before connect: no event is missed
                mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                self._monitors[mon] = endpoint
                self._poller.register(mon, zmq.POLLIN)
            s.connect(endpoint)
            self._dealers[endpoint] = s
            self._poller.register(s.getsockopt(zmq.FD), zmq.POLLIN)
        return s

    def reached(self, endpoint: str) -> bool:
        """Whether a connection to ``endpoint`` was ever made (watched DEALERs only): until
        then nothing sent to it has left this process."""
        return endpoint in self._reached

    def discard(self, endpoint: str) -> None:
        """I/O thread only (e.g. from ``on_tick``): close the DEALER to ``endpoint``, dropping
        every message still waiting in it; a later send connects afresh."""
        with self._sock_lock:
            s = self._dealers.pop(endpoint, None)
            if s is None:
                return
            self._poller.unregister(s.getsockopt(zmq.FD))
            for mon, ep in list(self._monitors.items()):
                if ep == endpoint:
                    self._poller.unregister(mon)
                    del self._monitors[mon]
                    mon.close(0)
            s.close(0)
        log.info("control connection to %s discarded (never made): what waited for it is dropped", endpoint)

    def _watch(self, events: dict) -> None:
        """Report the DEALER connections that closed since the last poll."""
        from zmq.utils.monitor import recv_monitor_message

        for mon, ep in list(self._monitors.items()):
            if mon not in events:
                continue
            while mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    ev = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_CONNECTED:
                    self._reached.add(ep)
                elif ev["event"] == zmq.EVENT_DISCONNECTED:
                    log.info("control connection to %s closed", ep)
                    try:
                        self._on_disconnect(ep)
                    except Exception:
                        log.exception("control disconnect handler failed for %s", ep)

    def _flush(self) -> None:
        """Send what waited for a DEALER to be connected (all of it under the lock, so that
        no direct send to the same endpoint overtakes it)."""
        if self._out.empty():  # the usual case: nothing waits (no exception raised to find out)
            return
        with self._sock_lock:
            while True:
                try:
                    peer, payload = self._out.get_nowait()
                except queue.Empty:
                    return
                self._send_on(self._dealer(peer), peer, payload)

    def _read(self, sock: zmq.Socket):
        """The messages waiting on ``sock``, each as its list of frames, until none is left
        (asked through ZMQ_EVENTS, which also re-arms its ZMQ_FD); the lock is held only
        while reading, never while a message is handled."""
        while True:
            with self._sock_lock:
                if self._closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
            yield frames

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                events = dict(self._poller.poll(self._tick_ms))
                if self._wake_rx in events:
                    while self._wake_rx.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._wake_rx.recv(zmq.NOBLOCK)
                self._flush()
                if self._monitors:
                    self._watch(events)
                # deadlines and silences next, on what was seen before this poll: a process
                # resuming from a stall (SIGSTOP, a long pause) judges its peers by that, not
                # by the frames they queued while it was stopped
                try:
                    self._on_tick()
                except Exception:
                    log.exception("control tick failed")
                self._flush()  # what the tick queued for a new endpoint
                if self._router is not None:
                    for frames in self._read(self._router):
                        if len(frames) != 2:  # [routing id, payload]; more frames could name another peer's id
                            self.refused_frames += 1
                            self._bad.warn("frames", "from %s: %d frames, expected 1", frames[0].hex(), len(frames) - 1)
                            continue
                        self._dispatch(frames[0].hex(), frames[1])
                for ep, s in list(self._dealers.items()):
                    for frames in self._read(s):
                        if len(frames) != 1:
                            self.refused_frames += 1
                            self._bad.warn("frames", "from %s: %d frames, expected 1", ep, len(frames))
                            continue
                        self._dispatch(ep, frames[0])
        finally:
            with self._sock_lock:
                self._closed = True
                for mon in self._monitors:
                    mon.close(0)
                for s in self._dealers.values():
                    s.close(0)
                if self._router is not None:
                    self._router.close(0)
            self._wake_rx.close(0)

    def _dispatch(self, peer: str, payload: bytes) -> None:
        try:
            self._on_message(peer, payload)
        except Exception:
            log.exception("control message from %s failed", peer)
