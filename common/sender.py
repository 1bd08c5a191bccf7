"""The prefill side of a handoff: ``KVSender``, one per prefill rank.

It takes ``TransferRequest``s on its control endpoint, checks each (version, auth, model
and layout compatibility, that every byte it would write lies inside the blocks the
receiver allocated for that room), and as each prefill chunk's KV is ready has a send
worker plan and write it (``kvbridge.common.send_pipeline``). Rooms have deadlines; a
decode peer silent for ``peer_timeout_s`` is gone; ``abort`` and a decode's ``Abort``
end a room; its blocks go back exactly once (``BlockLease``).

A room that ends while a send worker holds it is *settled* first: no further piece goes
out (each is guarded right before it enters the transport), and every piece already in
the transport is waited out, however long that takes. Only then are its decode ranks
told, with a ``quiet`` TransferFailed (their proof that nothing more lands in their
blocks), its source blocks released, and ``poll`` answers Failed. No timer cuts this
short.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from kvbridge.layout import KVLayout, LayoutError, block_ranges, check_compatible, digest_algorithm_for

from . import protocol as P
from .blocks import BlockLease
from .metrics import HandoffRecord, KVBridgeMetrics
from .rooms import TERMINAL, ControlSide, RoomState
from .settings import HandoffConfig
from .send_pipeline import SendPipeline
from .send_rooms import SendChunk, SendRoom, SendTarget
from .limits import BoundedMap
from .transport import MooncakeTransport

__all__ = ["KVSender"]

log = logging.getLogger(__name__)

MAX_EARLY_ROOMS = 4096  # requests for rooms a sender has not registered yet, at most (then refused)
MAX_EARLY_PEERS = 1024  # decode ranks whose early request for one room a sender keeps (then refused)
MAX_DECLINED = 1 << 14  # rooms declined before the prefill added them, remembered until their deadline at most


class KVSender(ControlSide):
    """Prefill side of one rank: serves TransferRequests for its rooms.

    Called by the prefill engine: ``add_room`` when a request is admitted (with the
    blocks it holds, and how to release them), ``send_chunk`` after each prefill chunk
    with the blocks and token range just computed, ``poll``/``abort``; the decode side
    reaches it at ``endpoint``.

    Threads: engine threads call the public methods; the control channel's I/O thread
    runs ``_on_message`` (requests, heartbeats, aborts) and ``_on_tick`` (deadlines, silent
    peers); send workers (``_pool``) run the pipeline's ``drain`` for one room at a time
    (``busy``; ``kvbridge.common.send_pipeline``, which reaches this sender as its
    ``SenderSide``). ``_lock`` guards ``_rooms``, ``_early``, ``_declined``,
    ``_peer_layouts``, every room's ``state``, ``targets``, ``chunks``, ``busy`` and
    ``prestaged``, and the pipeline's prestage slots.
    """

    role = "sender"

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, *, host: str = "127.0.0.1",
                 config: HandoffConfig | None = None, metrics: KVBridgeMetrics | None = None, workers: int = 2):
        self._rooms: dict[int, SendRoom] = {}
        self._early: dict[int, dict[str, tuple[P.TransferRequest, float]]] = {}  # room -> peer -> (request, when)
        self._declined: dict[int, tuple[str, float]] = BoundedMap(  # room -> (reason, when): declined before add_room
            MAX_DECLINED, name="declined", on_evict=self._evicted)
        self.incarnation = uuid.uuid4().hex[:16]  # this process's sender: a restart behind the same endpoint changes it
        super().__init__(layout, transport, config, metrics, bind_host=host)
        for t in layout.tensors or ():
            transport.register_tensor(t)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-send")
        self.pipeline = SendPipeline(self, layout, transport, self.config, self.metrics, workers)

    @property
    def endpoint(self) -> str:
        """The control endpoint decode ranks send TransferRequests to."""
        return self.channel.endpoint

    # -- engine-facing ------------------------------------------------------------------
    def add_room(self, room: int, blocks: Sequence[int] = (), release: Callable[[np.ndarray, bool], None] | None = None,
                 deadline_s: float | None = None) -> None:
        """Prefill engine, on admitting request ``room``: it will prefill here. ``release``
        gets ``blocks`` back once the handoff is over (delivered or given up)."""
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} already exists on this sender")
            rec = HandoffRecord(room=room, role=self.role)
            r = SendRoom(room, time.monotonic() + (deadline_s or self.config.deadline_s), rec)
            r.lease = BlockLease(room, blocks, release, self._count_blocks)
            self._rooms[room] = r
            self.metrics.child(self.metrics.inflight, self.role).inc()
            early = self._early.pop(room, {})
            declined = self._declined.pop(room, None)
        if declined is not None:  # the decode side decided to compute this prompt itself (or gave it up)
            self._fail(room, f"declined by decode: {declined[0]}", code="declined", notify=False)
            for peer, (req, _) in early.items():
                self._refuse(peer, room, f"room {room} was declined by a decode rank", "room_failed", attempt=req.attempt)
            return
        for peer, (req, heard) in early.items():  # every decode rank that asked before the room existed
            self._accept(peer, req, heard)

    def send_chunk(self, room: int, blocks, start: int, stop: int, *, last: bool, first_token: int = 0,
                   aux: dict | None = None, layers: tuple[int, int] | None = None) -> None:
        """Prefill engine, after a chunk: tokens ``[start, stop)`` of ``room`` are in ``blocks``
        (a block list in token order whose entry 0 holds token ``first_token``). With the
        last chunk, ``aux`` (e.g. ``{"output_ids": [first_token_id]}``) reaches the decode
        side in the same message that reports the KV landed.

        Layer-wise (``layers=(a, b)``, called by the forward after layer ``b - 1`` wrote its
        KV): only layers ``[a, b)`` of those tokens are ready; they go on the wire while
        later layers compute. One token range's layers come in order from 0 to the last
        before the next range starts; ``last`` may be given with every piece of the final
        range, and the piece that reaches the last layer ends the room (with ``aux``), or
        ``finish`` does. Raises ValueError for a piece out of order."""
        nl = self.layout.num_layers
        if layers is not None:
            a, b = int(layers[0]), int(layers[1])
            if not 0 <= a < b <= nl:
                raise ValueError(f"room {room}: layer range [{a}, {b}) outside this pool's {nl} layers")
            layers = None if (a, b) == (0, nl) else (a, b)
        a, b = layers or (0, nl)
        with self._lock:
            r = self._live_room(room)
            if r is None:
                return
            if r.chunks and r.chunks[-1].last:
                raise ValueError(f"room {room}: chunk after the last one")
            cur = r.layer_cursor
            if cur is not None and ((start, stop) != cur[:2] or a != cur[2]):
                raise ValueError(f"room {room}: tokens [{start}, {stop}) layers [{a}, {b}) while tokens "
                                 f"[{cur[0]}, {cur[1]}) wait for layer {cur[2]} next")
            if cur is None and a != 0:
                raise ValueError(f"room {room}: tokens [{start}, {stop}) start at layer {a}, not 0")
            r.layer_cursor = (start, stop, b) if b < nl else None
            done = last and b == nl
            r.chunks.append(SendChunk(np.asarray(blocks, dtype=np.int64), first_token, start, stop, done,
                                   aux if done else None, layers))
        self._kick(r)

    def _live_room(self, room: int) -> "SendRoom | None":
        """The room a piece is given for (caller holds ``_lock``): None once it ended (the
        piece is dropped); KeyError when it is not on this sender."""
        r = self._rooms.get(room)
        if r is None:
            raise KeyError(f"room {room} is not on this sender")
        return None if r.state in TERMINAL else r

    def finish(self, room: int, aux: dict | None = None) -> None:
        """Prefill engine, after a layer-wise prefill whose pieces were all given without
        ``last`` (e.g. the first token is sampled after the forward): the token range given
        last is the room's last; ``aux`` rides with the final TransferDone, which goes out
        once every piece has landed. Raises ValueError while a range misses layers."""
        with self._lock:
            r = self._live_room(room)
            if r is None:
                return
            if not r.chunks or r.chunks[-1].last:
                raise ValueError(f"room {room}: finish {'before any chunk' if not r.chunks else 'after the last chunk'}")
            if r.layer_cursor is not None:
                s0, s1, nxt = r.layer_cursor
                raise ValueError(f"room {room}: finish while tokens [{s0}, {s1}) have layers {nxt}.. to come")
            stop = r.chunks[-1].stop
            r.chunks.append(SendChunk(np.zeros(0, dtype=np.int64), stop, stop, stop, True, aux))
        self._kick(r)

    def poll(self, room: int) -> RoomState:
        """The room's state as its engine may act on it (Failed for an unknown room): a
        failed room that was given KV to send reads Transferring until it settled, since a
        piece still in the transport may read its source blocks (one that was given none,
        e.g. still bootstrapping, has nothing to read: Failed at once)."""
        r = self._rooms.get(room)
        if r is None:
            return RoomState.FAILED
        if r.state is RoomState.FAILED and not r.settled and r.chunks:
            return RoomState.TRANSFERRING
        return r.state

    def requests(self, room: int) -> list[P.TransferRequest]:
        """The accepted TransferRequests of the room's decode ranks (e.g. to learn the
        prefix they already hold)."""
        with self._lock:
            r = self._rooms.get(room)
            return [t.request for t in r.targets.values()] if r is not None else []

    def failure_reason(self, room: int) -> str:
        """Why the room failed ('' if it did not)."""
        r = self._rooms.get(room)
        return r.reason if r is not None else f"room {room} is not on this sender"

    def record(self, room: int) -> HandoffRecord | None:
        """The room's figures."""
        r = self._rooms.get(room)
        return r.record if r is not None else None

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        """Prefill engine: give the room up; the decode side is told."""
        self._fail(room, reason, code="aborted", notify=True)

    def forget(self, room: int) -> None:
        """Drop a finished room's bookkeeping (once its send worker let go of it, if one
        still holds it: its blocks may be released just before the worker returns)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.state in TERMINAL:
                if r.busy:
                    r.forgotten = True
                else:
                    del self._rooms[room]

    def close(self) -> None:
        """Fail open rooms, stop workers and the control channel, and unregister the
        staging this sender registered (the pool stays registered: the engine owns it)."""
        for room in list(self._rooms):
            if self._rooms[room].state not in TERMINAL:
                self._fail(room, "sender shutting down", code="shutdown", notify=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()
        self.pipeline.close()

    # -- control plane (I/O thread) -----------------------------------------------------
    def _on_message(self, peer: str, msg) -> None:
        if isinstance(msg, P.TransferRequest):
            self._accept(peer, msg, self._frame_at)
        elif isinstance(msg, P.Heartbeat):
            self._send(peer, P.Heartbeat(room=msg.room, sender=self.endpoint, incarnation=self.incarnation))
        elif isinstance(msg, P.Abort):
            self._on_abort(peer, msg)
        else:
            self._refuse(peer, msg.room, f"unexpected {type(msg).__name__} from a decode peer: a sender takes "
                         "transfer_request, heartbeat and abort", "bad_message", attempt=getattr(msg, "attempt", 0))

    def _on_abort(self, peer: str, msg: P.Abort) -> None:
        """An Abort from a decode rank: from one pulling the room, it ends the room; from
        one that has not asked (or whose request waits for the room to exist), it declines
        the room: the decode side computes the prompt itself, so the room ends now (or as
        soon as the prefill engine adds it) and its blocks are released."""
        with self._lock:
            r = self._rooms.get(msg.room)
            target = r is not None and peer in r.targets
            self._early.get(msg.room, {}).pop(peer, None)
            if msg.room in self._early and not self._early[msg.room]:
                del self._early[msg.room]
        if target:
            if r.state in TERMINAL:  # asked again (our answer was lost, or it came before we settled)
                self._answer_when_settled(r, peer, msg.attempt)
                return
            self._fail(msg.room, f"aborted by decode: {msg.reason}", code="aborted", notify=True)
            return
        if r is None:
            with self._lock:
                self._declined[msg.room] = (msg.reason, time.monotonic())
            self._send(peer, P.TransferFailed(room=msg.room, reason="abort acknowledged: room unknown",
                                              code="unknown_room", quiet=True, attempt=msg.attempt))  # nothing in flight
            return
        if r.state in TERMINAL:  # e.g. a decode refused while a replay of its request was served: told once settled
            self._answer_when_settled(r, peer, msg.attempt)
            return
        self._fail(msg.room, f"declined by decode: {msg.reason}", code="declined", notify=True)

    def _refuse(self, peer: str, room: int, reason: str, code: str, session: str = "", *, attempt: int) -> None:
        """Refuse ``peer``'s request (its ``attempt``) for ``room``. The refusal is quiet
        unless the room may still write to ``session`` (the requester's transfer engine) for
        another target, e.g. a replay of this request that came first; then ``peer`` is told
        again once the room settled."""
        log.warning("sender: refused room %s from %s: %s", room, peer, reason)
        with self._lock:
            r = self._rooms.get(room)
            loud = (r is not None and not r.settled and bool(session)
                    and any(t.request.session == session for t in r.targets.values()))
            if loud:
                r.watchers[peer] = attempt
        self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=not loud, attempt=attempt))

    def _answer_when_settled(self, r: SendRoom, peer: str, attempt: int) -> None:
        """``peer`` asks (for its request's ``attempt``) about ended room ``r``: a quiet answer
        now if it settled, else once it has."""
        with self._lock:
            if not r.settled:
                r.watchers[peer] = attempt
                return
        self._send(peer, P.TransferFailed(room=r.room, reason=r.reason or "room ended", code="settled", quiet=True,
                                          attempt=attempt))

    def _accept(self, peer: str, req: P.TransferRequest, heard: float) -> None:
        """Take ``peer``'s request (its frame arrived at ``heard``), or refuse it."""
        cfg = self.config
        # a refused room fails before the refusal goes out: the decode's answer to it (an
        # engine's abort notice, on another channel) must find the room failed with this reason
        if cfg.model and req.model and req.model != cfg.model:
            self._fail(req.room, f"decode peer runs model {req.model!r}", code="incompatible", notify=False)
            self._refuse(peer, req.room, f"model mismatch: sender serves {cfg.model!r}, receiver {req.model!r}", "incompatible",
                         attempt=req.attempt)
            return
        with self._lock:
            r = self._rooms.get(req.room)
            if r is None:
                if req.room not in self._early and len(self._early) >= MAX_EARLY_ROOMS:
                    self._refuse(peer, req.room, f"unknown room {req.room}: already {len(self._early)} requests wait "
                                 "for rooms this prefill has not registered", "unknown_room", attempt=req.attempt)
                    return
                waiting = self._early.setdefault(req.room, {})
                if peer not in waiting and len(waiting) >= MAX_EARLY_PEERS:
                    self._refuse(peer, req.room, f"room {req.room}: already {len(waiting)} decode ranks wait for it",
                                 "unknown_room", attempt=req.attempt)
                    return
                waiting[peer] = (req, heard)
                return
            if r.state is RoomState.FAILED:
                self._refuse(peer, req.room, f"room {req.room} already failed: {r.reason}", "room_failed", req.session,
                             attempt=req.attempt)
                return
            if peer in r.targets:
                return  # a duplicate (replayed) request changes nothing
            if len(r.targets) >= max(r.expected, req.receivers):
                self._refuse(peer, req.room, f"room already pulled by {len(r.targets)} decode rank(s)", "conflict",
                             req.session, attempt=req.attempt)
                return
        try:
            remote = self._remote_layout(peer, req.layout)
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            if blocks.size and ((blocks < remote.first_block) | (blocks >= remote.num_blocks)).any():
                raise LayoutError("receiver block ids outside its own pool")
            if not 0 <= req.token_start < req.token_stop:
                raise LayoutError(f"empty token range [{req.token_start}, {req.token_stop})")
            # the digest's algorithm: of those it accepts, the one cheapest where this pool lies, or refused
            algorithm = digest_algorithm_for(self.layout, req.digest_algorithms) if req.digest else ""
        except (LayoutError, ValueError, TypeError, OverflowError) as e:  # whatever a hostile layout triggers
            reason = f"incompatible layouts: {e}"
            self._fail(req.room, reason, code="incompatible", notify=True)
            self._refuse(peer, req.room, reason, "incompatible", attempt=req.attempt)
            return
        with self._lock:
            r.targets[peer] = SendTarget(peer, req, remote, block_ranges(remote, blocks), blocks,
                                      layer_bytes=np.zeros(self.layout.num_layers, dtype=np.int64),
                                      digest_algorithm=algorithm)
            r.expected = max(r.expected, req.receivers)
            if not r.record.asked_at:
                r.record.heard_at, r.record.asked_at = heard, time.monotonic()
            if r.state is RoomState.BOOTSTRAPPING:
                r.state = RoomState.WAITING
        self._kick(r)

    def _remote_layout(self, peer: str, desc: P.LayoutDescription) -> KVLayout:
        """The decode peer's layout, checked against ours; a warm peer's is reused while it
        describes the same layout (raises LayoutError naming the mismatch)."""
        return self._peer_layout(peer, desc, check=lambda remote: check_compatible(self.layout, remote))

    def _on_tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        for room, waiting in list(self._early.items()):
            for peer, (req, t) in list(waiting.items()):
                if now - t > cfg.deadline_s:
                    waiting.pop(peer, None)
                    self._refuse(peer, room, f"unknown room {room}: no prefill registered it within {cfg.deadline_s:.1f} s",
                                 "unknown_room", attempt=req.attempt)
            if not waiting:
                self._early.pop(room, None)
        for room, (_, t) in list(self._declined.items()):
            if now - t > cfg.deadline_s:  # the prefill never added the room: nothing to release
                self._declined.pop(room, None)
        for r in list(self._rooms.values()):
            if r.state in TERMINAL:
                continue
            if now > r.deadline:
                self._fail(r.room, f"deadline exceeded in state {r.state.name}", code="timeout", notify=True)
            else:
                served = bool(r.chunks) and r.chunks[-1].last
                silent = [p for p, t in r.targets.items()
                          if not (served and t.sent == len(r.chunks)) and now - self._peers_seen.get(p, now) > cfg.peer_timeout_s]
                if silent:
                    self._fail(r.room, f"decode peer silent for {cfg.peer_timeout_s:.1f} s", code="peer_gone", notify=True)

    def _kick(self, r: SendRoom) -> None:
        with self._lock:
            if r.busy or r.state in TERMINAL or (self.pipeline.next_work(r) is None and not self.pipeline.prestage_due(r)):
                return
            r.busy = True
        self._pool.submit(self.pipeline.drain, r)

    # -- what the send pipeline asks of this sender (send_pipeline.SenderSide) -----------
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def last_heard(self, peer: str) -> float | None:
        return self._peers_seen.get(peer)

    def control_pending(self) -> bool:
        return self.channel.pending()

    def reply(self, peer: str, msg) -> None:
        self._send(peer, msg)

    def succeed(self, r: SendRoom) -> None:
        self._succeed(r)

    def fail(self, room: int, reason: str, code: str) -> None:
        self._fail(room, reason, code=code, notify=True)

    def worker_done(self, r: SendRoom) -> None:
        with self._lock:
            if r.forgotten and r.state in TERMINAL and self._rooms.get(r.room) is r:
                del self._rooms[r.room]  # forget() came while a worker held it
        self._kick(r)

    def _succeed(self, r: SendRoom) -> None:
        with self._lock:
            if r.state in TERMINAL:
                return
            r.note_plan_reason()
            r.state = RoomState.SUCCESS
            rec = r.record
            rec.finished, rec.result = time.monotonic(), "success"
        self.pipeline.drop_prestage(r, used=False)
        r.lease.release(True)
        self._settled(r)
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(rec)

    def _settled(self, r: SendRoom, code: str = "settled") -> None:
        """Room ``r`` ended and nothing of it is in the transport: peers waiting to hear so
        are told (a quiet TransferFailed with ``code``)."""
        with self._lock:
            r.settled = True
            watchers, r.watchers = r.watchers, {}
        for peer, attempt in watchers.items():
            self._send(peer, P.TransferFailed(room=r.room, reason=r.reason or "room ended", code=code, quiet=True,
                                              attempt=attempt))

    def _fail(self, room: int, reason: str, *, code: str, notify: bool) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state in TERMINAL:
                return
            r.note_plan_reason()
            r.state, r.reason = RoomState.FAILED, reason
            r.record.finished, r.record.result, r.record.reason = time.monotonic(), (
                code if code in ("aborted", "declined") else "failed"), reason
            busy = r.busy
        log.warning("sender: room %s failed: %s", room, reason)
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(r.record)
        if busy:  # the decode ranks hear of it now, and that it is quiet once no write of ours can still land
            if notify:
                for peer, t in list(r.targets.items()):
                    self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=False,
                                                      attempt=t.request.attempt))
            threading.Thread(target=self._settle_when_idle, args=(r, notify, code), daemon=True).start()
        else:
            self._settle(r, notify, code)

    def _settle(self, r: SendRoom, notify: bool, code: str) -> None:
        """No send worker holds failed room ``r`` (its writes are out of the transport): tell
        its decode ranks it is quiet, release its blocks."""
        if notify:
            with self._lock:
                r.watchers.update({peer: t.request.attempt for peer, t in r.targets.items()})
        self.pipeline.drop_prestage(r, used=False)
        r.lease.release(False)
        self._settled(r, code)

    def _settle_when_idle(self, r: SendRoom, notify: bool, code: str) -> None:
        """Wait until the send worker let go of ``r`` (it leaves only once every piece it
        handed the transport is final), then settle it. No timeout: a piece still in the
        transport may land in the decode's blocks, and the transport bounds its own."""
        while r.busy:
            time.sleep(0.002)
        self._settle(r, notify, code)
