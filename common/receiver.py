"""The decode side of a handoff: ``KVReceiver``, one per decode rank.

It allocates nothing itself: the decode engine hands it a room's blocks, and it sends
every prefill rank holding part of the request a ``TransferRequest`` (its layout, block
ids, the tokens it already holds, its transfer-engine session, an auth tag), then waits
for each one's ``TransferDone``.

The release rule: a room's blocks go back to the engine only when no sender can still
write into them. A sender is proven quiet when its writes completed (its Done), when it
acknowledged the room's end with nothing left in its transport (a ``quiet``
TransferFailed), when its control connection closed (its process is gone; then
``gone_drain_s`` for what its kernel had queued), or when its endpoint answers with
another incarnation (the process was replaced). A timer alone never proves it. A failing
room reports Failed once every sender is quiet or after ``quiesce_s``; blocks a sender
may still write are then *quarantined*: kept from the engine, counted
(``kvbridge_quarantined_blocks{peer, reason}``), logged once, re-asked to stop every
heartbeat, and released the moment the proof arrives.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgspec
import numpy as np
import torch

from kvbridge.layout import (CopySpec, DigestGrid, KVLayout, LayoutError, accepted_algorithms, first_difference,
                             kv_digest)
from kvbridge.layout.repack import Scatter

from . import protocol as P
from .blocks import BlockLease
from .metrics import HandoffRecord, KVBridgeMetrics
from .rooms import TERMINAL, ControlSide, PeerState, RoomState
from .copy_choice import copy_split, threads_taken
from .limits import LogLimiter
from .settings import HandoffConfig
from .staging import Arena, staging_buffer
from .transport import MooncakeTransport

__all__ = ["KVReceiver"]

log = logging.getLogger(__name__)


@dataclass
class _RecvRoom:
    room: int
    deadline: float
    record: HandoffRecord
    lease: BlockLease
    peers: dict[str, PeerState]  # endpoint -> its state
    attempt: int = 0  # this request's use of the room id (protocol.Attempt): answers carrying another are stale
    first_token: int = 0
    tokens: tuple[int, int] = (0, 0)  # [start, stop): what the senders fill (tokens before start it already holds)
    need_bytes: int = 0  # what this room's tokens and heads take: the senders' Done must account for it
    layer_bytes: np.ndarray | None = None  # int64 [num_layers]: what the senders' Done report per layer, summed
    staging: dict[str, tuple[int, int]] = field(default_factory=dict)  # endpoint -> (offset, bytes)
    state: RoomState = RoomState.BOOTSTRAPPING
    reason: str = ""
    code: str = ""  # the failure's short cause (TransferFailed codes: aborted, timeout, peer_gone...)
    closing_since: float | None = None
    quarantine: tuple[str, str, int] | None = None  # (peer, reason, blocks) counted in the quarantine gauge
    forgotten: bool = False  # forget() came while quarantined: dropped once released
    aux: dict = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    verify: bool = False  # compare the senders' content digests with what landed (HandoffConfig.integrity)


class KVReceiver(ControlSide):
    """Decode side of one rank: pulls rooms from prefill senders into its own blocks.

    Called by the decode engine: ``request`` once blocks are allocated, ``poll`` until
    Success or Failed, ``abort`` to give up. ``release`` passed to ``request`` gets the
    blocks back exactly once: with True when they hold the KV, False when they are free.

    Threads: engine threads call the public methods; the control channel's I/O thread
    runs ``_on_message`` and ``_on_tick`` (heartbeats, deadlines, silent peers); one
    scatter thread runs ``_land`` (the scatter of staged_recv plans, content digests). ``_lock`` guards ``_rooms``,
    ``_declined`` and every room's ``state``, ``peers``, ``closing_since`` and record.
    """

    role = "receiver"

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, *, config: HandoffConfig | None = None,
                 metrics: KVBridgeMetrics | None = None):
        self._rooms: dict[int, _RecvRoom] = {}
        self._declined: deque = deque(maxlen=4096)  # rooms declined lately (their acks are expected)
        self._last_ping = 0.0
        self._closed_at: dict[str, tuple[float, int]] = {}  # prefill endpoint -> (when its control connection closed, ping then)
        self._ping = 0  # heartbeat round: a sender echoes it, so a reply to a later round came over a new connection
        self._incarnation: dict[str, str] = {}  # prefill endpoint -> the incarnation its heartbeats carry
        self._layout_desc = P.LayoutDescription.of(layout)  # what every request carries (the layout never changes)
        self._stale = LogLimiter(log, "receiver: answers to an earlier request under the same room id")
        super().__init__(layout, transport, config, metrics, bind_host=None)
        self._digest_algorithms = accepted_algorithms(layout, self.config.integrity_hash)  # asked for where it verifies
        for t in layout.tensors or ():
            transport.register_tensor(t)
        n = self.config.recv_staging_bytes
        self._arena = Arena(n)
        self._staging = None
        if n:
            self._staging = staging_buffer(n, layout.device or "cpu")  # faulted in now, not on a request's time
            transport.register_tensor(self._staging)
        self._scatter_pool = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-scatter")
        # the scatter's C copy over config.gather_threads threads (copy_choice: one beside TCP)
        self._split, self._split_pool = copy_split(self.config.gather_threads, "kvbridge-scatter-copy")

    def request(self, room: int, endpoints: str | Sequence[str], blocks, start: int, stop: int,
                release: Callable[[np.ndarray, bool], None] | None = None, *, first_token: int = 0,
                deadline_s: float | None = None, receivers: int = 1) -> None:
        """Decode engine, after allocating ``blocks`` (in token order, entry 0 holding token
        ``first_token``) for tokens ``[0, stop)`` of ``room``, of which ``[0, start)`` it
        already holds: ask every prefill rank at ``endpoints`` for its part. ``receivers``
        is how many decode ranks pull the room from each of those prefill ranks (decode TP
        over prefill TP when decode has more ranks)."""
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("at least one prefill endpoint is needed")
        ids = np.asarray(blocks, dtype=np.int64)
        lay = self.layout
        if ids.size and (int(ids.min()) < lay.first_block or int(ids.max()) >= lay.num_blocks):
            raise ValueError(f"room {room}: block ids outside this pool's {lay.first_block}..{lay.num_blocks - 1}")
        verifies = self.config.verifies(room)
        attempt = secrets.randbits(63) or 1
        try:  # validate everything before the room exists, so a bad request leaks nothing
            base = P.TransferRequest(
                room=room, model=self.config.model, layout=self._layout_desc, block_ids=ids.tolist(),
                first_token=first_token, token_start=start, token_stop=stop, session=self.transport.session_id,
                sent_at=time.time(), receivers=receivers, digest=verifies,
                digest_algorithms=self._digest_algorithms if verifies else [], attempt=attempt,
            )
            payload = P.encode(base)  # checked as the peer will check it; sent as is where nothing changes
        except P.ProtocolError as e:
            raise ValueError(f"room {room}: {e}") from None
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} already exists on this receiver")
            rec = HandoffRecord(room=room, role=self.role)
            lease = BlockLease(room, blocks, release, self._count_blocks)
            r = _RecvRoom(room, time.monotonic() + (deadline_s or self.config.deadline_s), rec, lease,
                          {ep: PeerState.PENDING for ep in eps}, attempt)
            self._rooms[room] = r
            self.metrics.child(self.metrics.inflight, self.role).inc()
        r.first_token, r.tokens, r.verify = first_token, (start, stop), base.digest
        r.need_bytes = (stop - start) * self.layout.num_layers * self.layout.kv_factor * self.layout.token_bytes
        r.layer_bytes = np.zeros(self.layout.num_layers, dtype=np.int64)
        # staging for staged_recv plans: one slice per sender, or none at all
        if self._staging is not None:
            need = r.need_bytes
            for ep in eps:
                off = self._arena.alloc(need)
                if off is None:
                    self._free_staging(r)
                    break
                r.staging[ep] = (off, need)
        now = time.monotonic()
        for ep in eps:
            msg = base
            if ep in r.staging:
                off, n = r.staging[ep]
                msg = msgspec.structs.replace(base, staging_addr=self._staging.data_ptr() + off, staging_bytes=n)
            self._peers_seen[ep] = now  # a fresh request starts a fresh liveness window
            if msg is base:  # encoded and checked above: sealed, not encoded again
                self._send_encoded(ep, payload)
            else:
                self._send(ep, msg)
        with self._lock:
            if r.state is RoomState.BOOTSTRAPPING:
                r.state = RoomState.WAITING

    def poll(self, room: int) -> RoomState:
        """The room's state (Failed for an unknown room)."""
        r = self._rooms.get(room)
        return r.state if r is not None else RoomState.FAILED

    def quarantined(self, room: int) -> bool:
        """Whether the room ended while a sender may still write into its blocks, which the
        engine therefore does not have back yet (False for an unknown room)."""
        r = self._rooms.get(room)
        return r is not None and r.state is RoomState.FAILED and not r.lease.released

    def settled(self, room: int) -> bool:
        """Whether the engine may have room ``room``'s blocks: it ended and no sender can
        write into them any more (True for a room this receiver does not know)."""
        r = self._rooms.get(room)
        return r is None or (r.state in TERMINAL and r.lease.released)

    def quarantine(self) -> list[dict]:
        """Every quarantined room: ``room``, ``blocks``, ``peers`` not proven quiet, ``reason``,
        ``seconds`` since it ended (for ``kvbridge doctor`` and operators)."""
        now = time.monotonic()
        with self._lock:
            return [{"room": r.room, "blocks": int(r.lease.blocks.size), "reason": r.reason,
                     "peers": [ep for ep, s in r.peers.items() if s not in (PeerState.DONE, PeerState.FAILED)],
                     "seconds": round(now - (r.record.finished or now), 3)}
                    for r in self._rooms.values() if r.state is RoomState.FAILED and not r.lease.released]

    def wait(self, room: int, timeout_s: float | None = None) -> RoomState:
        """Block until the room is Success or Failed (or ``timeout_s``); returns the state."""
        r = self._rooms.get(room)
        if r is None:
            return RoomState.FAILED
        r.done.wait(timeout_s)
        return r.state

    def failure_reason(self, room: int) -> str:
        """Why the room failed ('' if it did not)."""
        r = self._rooms.get(room)
        return r.reason if r is not None else f"room {room} is not on this receiver"

    def record(self, room: int) -> HandoffRecord | None:
        """The room's figures."""
        r = self._rooms.get(room)
        return r.record if r is not None else None

    def aux(self, room: int) -> dict:
        """What the prefill side sent beside the KV (``output_ids``...), once Success."""
        r = self._rooms.get(room)
        return dict(r.aux) if r is not None else {}

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        """Decode engine: give the room up; the prefill side is told."""
        self._begin_fail(room, reason, code="aborted", notify=True)

    def decline(self, room: int, endpoints: str | Sequence[str], reason: str, *,
                label: str = "below_break_even") -> HandoffRecord:
        """Decode engine, instead of ``request``: this room's KV will not be pulled (the
        decode side computes the prompt itself). Every prefill rank at ``endpoints`` is told
        (an ``Abort``), so it ends the room and releases its
        blocks now, or when its engine adds the room. No block of ours is involved. Counts
        ``kvbridge_fallbacks_total{role="receiver", reason=label}``; returns the record."""
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("at least one prefill endpoint is needed")
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.state not in TERMINAL:
                raise ValueError(f"room {room} is being pulled on this receiver; abort it instead")
            self._declined.append(room)
        msg = P.Abort(room=room, reason=reason[:4000])
        for ep in eps:
            self._send(ep, msg)
        rec = HandoffRecord(room=room, role=self.role, result="declined", reason=reason)
        rec.finished = rec.started
        self.metrics.observe(rec)
        self.metrics.fallbacks.labels(self.role, label).inc()
        log.info("receiver: room %s declined (%s): %s", room, label, reason)
        return rec

    def forget(self, room: int) -> None:
        """Drop a finished room's bookkeeping (a quarantined room's once it is released)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.state in TERMINAL:
                if r.lease.released:
                    del self._rooms[room]
                else:
                    r.forgotten = True

    def close(self) -> None:
        """Fail open rooms and stop the control channel. Blocks still quarantined are not
        given back: the engine is going away with them."""
        for room in list(self._rooms):
            self._begin_fail(room, "receiver shutting down", code="shutdown", notify=True)
            self._finish_fail(self._rooms[room])
        left = self.quarantine()
        if left:
            log.warning("receiver: closing with %d room(s) quarantined (%d blocks never given back)",
                        len(left), sum(q["blocks"] for q in left))
        self._scatter_pool.shutdown(wait=True, cancel_futures=True)
        if self._split_pool is not None:
            self._split_pool.shutdown(wait=True)
        super().close()

    # -- control plane (I/O thread) -----------------------------------------------------
    def _on_message(self, peer: str, msg) -> None:
        if isinstance(msg, P.Heartbeat):
            self._on_heartbeat(peer, msg)
            return
        if isinstance(msg, P.TransferFailed) and msg.code == "auth" and msg.room == 0:
            self._peer_refuses(peer, msg.reason)
            return
        r = self._rooms.get(getattr(msg, "room", -1))
        if r is None or peer not in r.peers:
            if r is None and getattr(msg, "room", -1) in self._declined:
                return  # a prefill acknowledging a declined room
            if not isinstance(msg, P.Heartbeat):
                log.warning("receiver: %s for unknown room %s from %s", type(msg).__name__, getattr(msg, "room", "?"), peer)
            return
        if msg.attempt != r.attempt:  # about an earlier request under this room id (a late answer to its Abort)
            self._stale.warn(type(msg).__name__, "%s for room %s from %s answers attempt %x, not this request's %x: "
                             "ignored", type(msg).__name__, r.room, peer, msg.attempt, r.attempt)
            return
        if isinstance(msg, P.TransferDone):
            r.record.heard_at = self._frame_at
            if (msg.staged or r.verify) and r.closing_since is None:
                with self._lock:
                    r.peers[peer] = PeerState.SCATTERING  # the sender is done writing; our scatter or check is not
                self._scatter_pool.submit(self._land, r, peer, msg)
                return
            self._peer_done(r, peer, msg)
        elif isinstance(msg, P.TransferFailed):
            with self._lock:
                if r.peers[peer] is PeerState.SCATTERING:
                    pass  # its writes ended before its Done; our scatter or check of them ends the peer's part
                elif msg.quiet:
                    r.peers[peer] = PeerState.FAILED  # proven quiet
                elif r.peers[peer] is not PeerState.FAILED:
                    r.peers[peer] = PeerState.STOPPING  # it says it failed, not that nothing of it is in flight
            if msg.code != "settled" and r.state not in TERMINAL and r.closing_since is None:
                self._begin_fail(r.room, f"prefill {peer} failed the room: {msg.reason}", code=msg.code, notify=True)
            self._advance(r)
        elif isinstance(msg, P.Abort):
            with self._lock:
                if r.peers[peer] not in (PeerState.FAILED, PeerState.SCATTERING):
                    r.peers[peer] = PeerState.STOPPING  # until its quiet acknowledgement
            self._begin_fail(r.room, f"aborted by prefill: {msg.reason}", code="aborted", notify=False)
            self._advance(r)

    def _peer_done(self, r: _RecvRoom, peer: str, msg) -> None:
        nl = self.layout.num_layers
        with self._lock:
            r.peers[peer] = PeerState.DONE
            r.record.bytes += msg.bytes
            r.record.segments += msg.segments
            r.record.plan = msg.plan
            r.aux.update(msg.aux)
            if len(msg.layer_bytes) == nl:
                r.layer_bytes += np.asarray(msg.layer_bytes, dtype=np.int64)
            all_done = all(v is PeerState.DONE for v in r.peers.values())
        short = self._short_write(r, peer, msg, all_done)
        if short and r.state not in TERMINAL and r.closing_since is None:
            self._begin_fail(r.room, short, code="short_write", notify=True)
            self._advance(r)
        elif all_done and r.state not in TERMINAL and r.closing_since is None:
            self._succeed(r)
        else:
            self._advance(r)

    def _short_write(self, r: _RecvRoom, peer: str, msg, all_done: bool) -> str:
        """Why the senders' Done (``msg`` from ``peer`` the latest; ``all_done``: every
        sender's is in) do not account for every byte of every layer of the room ('' when
        they do, or may still). A sender counts what it wrote to every target of the room,
        so the sums are at least this room's share; less is a peer claiming bytes it never
        wrote (or layers it never sent)."""
        nl = self.layout.num_layers
        if all_done and r.record.bytes < r.need_bytes:
            return (f"prefill peers reported {r.record.bytes} B written, but the room's tokens need {r.need_bytes} B")
        if len(msg.layer_bytes) != nl:
            return (f"prefill {peer} reported bytes for {len(msg.layer_bytes)} layer(s), this pool has {nl}: "
                    "the room's layers cannot be accounted for")
        if not all_done:
            return ""
        per_layer = r.need_bytes // nl
        short = np.flatnonzero(r.layer_bytes < per_layer)
        if short.size:
            return (f"prefill peers reported {r.layer_bytes[short[0]]} B written into layer {int(short[0])} "
                    f"({short.size} layer(s) short), but each layer needs {per_layer} B")
        return ""

    def _land(self, r: _RecvRoom, peer: str, msg) -> None:
        """Scatter thread: what a sender's Done leaves this side to do before the room can be
        admitted: scatter what it staged (staged_recv plans), then compare the content
        digest (integrity on). Either failing fails the room, naming why."""
        try:
            if msg.staged:
                self._scatter(r, peer, msg)
        except Exception as e:  # a sender's Done is input: whatever it triggers fails the room, with the reason
            if not isinstance(e, (LayoutError, ValueError)):
                log.exception("receiver: room %s: scatter of what %s staged crashed", r.room, peer)
            self._refuse_done(r, peer, f"cannot scatter what prefill {peer} staged: {e}", "staging")
            return
        if r.verify:
            why = self._verify(r, peer, msg)
            if why:
                log.error("receiver: room %s: %s", r.room, why)
                self._refuse_done(r, peer, why, "integrity")
                return
        self._peer_done(r, peer, msg)

    def _refuse_done(self, r: _RecvRoom, peer: str, reason: str, code: str) -> None:
        """Fail ``r`` over ``peer``'s Done (the peer is done writing: proven quiet)."""
        with self._lock:
            r.peers[peer] = PeerState.FAILED
        self._begin_fail(r.room, reason, code=code, notify=True)
        self._advance(r)

    def _scatter(self, r: _RecvRoom, peer: str, msg) -> None:
        """Move what a sender wrote into our staging to our blocks (staged_recv plans)."""
        if peer not in r.staging:
            raise LayoutError("sender used receiver staging that was not offered to it")
        off, size = r.staging[peer]
        if msg.src_layout is None:
            raise LayoutError("staged chunks without the sender's layout (src_layout)")
        src = self._peer_layout(peer, msg.src_layout)
        t0 = time.perf_counter()
        for ch in msg.staged:
            if ch.start < r.tokens[0] or ch.stop > r.tokens[1]:  # e.g. prefix tokens other requests share
                raise LayoutError(f"staged chunk of tokens [{ch.start}, {ch.stop}) outside the tokens "
                                  f"[{r.tokens[0]}, {r.tokens[1]}) the room asked for")
            s_lay, d_lay = src, self.layout
            if ch.layer_stop:  # one layer range of a layer-wise send
                s_lay, d_lay = src.layer_range(ch.layer_start, ch.layer_stop), d_lay.layer_range(ch.layer_start, ch.layer_stop)
            spec = CopySpec.build(s_lay, ch.blocks, d_lay, r.lease.blocks, (ch.start, ch.stop),
                                  src_first_token=ch.first_token, dst_first_token=r.first_token)
            if ch.offset + spec.nbytes > size:
                raise LayoutError(f"staged chunk at {ch.offset} (+{spec.nbytes} B) overruns the {size} B offered")
            Scatter(spec).run(self._staging[off + ch.offset : off + ch.offset + spec.nbytes], split=self._split)
        r.record.repack_s += time.perf_counter() - t0
        r.record.copy_threads = max(r.record.copy_threads, threads_taken(self._split))

    def _verify(self, r: _RecvRoom, peer: str, msg) -> str:
        """'' when the content digest ``peer`` sent with its Done matches what landed in the
        room's blocks and covers every byte it reports, else why not (counted)."""
        m, t0 = self.metrics, time.perf_counter()
        result, why = "verified", ""
        try:
            if not msg.digest and msg.bytes == 0:
                pass  # nothing moved from this sender: nothing to compare
            elif not msg.digest:
                result, why = "missing", (f"prefill {peer} sent no content digest (integrity is on here; does it run "
                                          "a kvbridge without digests?)")
            elif msg.digest_algorithm not in self._digest_algorithms:
                result, why = "missing", (f"prefill {peer} digests with {msg.digest_algorithm!r}, this side accepts "
                                          f"{', '.join(map(repr, self._digest_algorithms))}")
            else:
                covered, r.record.digest_algorithm = 0, msg.digest_algorithm
                for part in msg.digest:
                    grid = DigestGrid(tuple(part.layers), self.layout.kv_factor, tuple(part.heads), tuple(part.tokens),
                                      part.unit_tokens)
                    if grid.units != len(part.values):
                        raise LayoutError(f"a digest part has {len(part.values)} values for its {grid.units} units")
                    got = kv_digest(self.layout, r.lease.blocks, r.first_token, grid, split=self._split,
                                    algorithm=msg.digest_algorithm)
                    diff = first_difference(grid, np.asarray(part.values, dtype=np.int64).view(np.uint64), got)
                    if diff:
                        result = "mismatch"
                        why = f"content digest mismatch: what landed from prefill {peer} is not what it sent, {diff}"
                        break
                    covered += ((grid.layers[1] - grid.layers[0]) * grid.kv_factor * grid.heads[1]
                                * (grid.tokens[1] - grid.tokens[0]) * self.layout.head_bytes)
                if not why and covered != msg.bytes:
                    raise LayoutError(f"its digest covers {covered} B, but it reports {msg.bytes} B written")
        except LayoutError as e:
            result, why = "mismatch", f"content digest from prefill {peer} does not fit this room: {e}"
        r.record.digest_s += time.perf_counter() - t0
        m.child(m.integrity, result).inc()
        if why:
            m.integrity_failures.inc()
        return why

    def _free_staging(self, r: _RecvRoom) -> None:
        for off, n in r.staging.values():
            self._arena.free(off, n)
        r.staging.clear()

    def _quiet(self, r: _RecvRoom) -> bool:
        """No sender of this room can still be writing (and no scatter of ours is running)."""
        return all(v in (PeerState.DONE, PeerState.FAILED) for v in r.peers.values())

    def _advance(self, r: _RecvRoom) -> None:
        """After a peer's state changed: a failing room ends once quiet, a quarantined
        room is released once quiet."""
        if r.state is RoomState.FAILED:
            if not r.lease.released and self._quiet(r):
                self._release_quarantine(r)
        elif r.closing_since is not None and self._quiet(r):
            self._finish_fail(r)

    def _on_heartbeat(self, peer: str, msg: P.Heartbeat) -> None:
        """A sender's heartbeat reply: one from another incarnation than before means the
        process that held our rooms was replaced (the proof of a restart)."""
        if not msg.incarnation:
            return
        known = self._incarnation.get(peer)
        self._incarnation[peer] = msg.incarnation
        if known is not None and known != msg.incarnation:
            self._closed_at.pop(peer, None)
            self._peer_gone(peer, f"prefill {peer} restarted (incarnation {known} -> {msg.incarnation})")
        elif peer in self._closed_at and msg.room >= self._closed_at[peer][1]:
            # the same process answered a ping sent after the close (the probe or a later one): it lives
            del self._closed_at[peer]

    def _on_disconnect(self, peer: str) -> None:
        if peer not in self._closed_at:
            self._ping += 1
            self._closed_at[peer] = (time.monotonic(), self._ping)
            self._send(peer, P.Heartbeat(room=self._ping, sender=self.transport.session_id))  # alive? it answers

    def _peer_refuses(self, peer: str, reason: str) -> None:
        """``peer`` answered (sealed with a key we accept) that it refuses our frames: a key
        rotation rolled out in the wrong order. Its open rooms fail now, naming it, instead
        of waiting out their deadline; their blocks stay quarantined (it is not proven quiet)."""
        self._refusals[peer] = f"it refuses ours: {reason}"
        for r in list(self._rooms.values()):
            with self._lock:
                if r.peers.get(peer) is not PeerState.PENDING:
                    continue
                r.peers[peer] = PeerState.STOPPING
            if r.state not in TERMINAL and r.closing_since is None:
                self._begin_fail(r.room, f"prefill peer {peer} refuses our frames ({reason}): its key differs from ours",
                                 code="auth", notify=True)
            self._advance(r)

    def _peer_gone(self, peer: str, why: str) -> None:
        """``peer``'s process is gone: nothing of it can be writing any more. Its rooms fail
        (if still open) and are released once otherwise quiet."""
        for r in list(self._rooms.values()):
            with self._lock:
                st = r.peers.get(peer)
                if st not in (PeerState.PENDING, PeerState.STOPPING):
                    continue
                r.peers[peer] = PeerState.FAILED
            if r.state not in TERMINAL and r.closing_since is None:
                self._begin_fail(r.room, f"prefill peer {peer} unreachable: {why}", code="peer_gone", notify=True)
            self._advance(r)

    def _on_tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        for ep, (t, _) in list(self._closed_at.items()):
            if now - t >= cfg.gone_drain_s:  # nobody answered there since: its process is gone
                del self._closed_at[ep]
                self._peer_gone(ep, "its control connection closed (process gone)")
        if now - self._last_ping >= cfg.heartbeat_s:
            self._last_ping = now
            waiting, stopping = set(), {}
            for r in list(self._rooms.values()):
                live = r.state not in TERMINAL
                for ep, s in list(r.peers.items()):
                    if s is PeerState.PENDING and live:
                        waiting.add(ep)
                    elif s is PeerState.STOPPING or (s is PeerState.PENDING and r.closing_since is not None):
                        stopping.setdefault(ep, []).append(r)  # not proven quiet: asked again until it answers
            self._ping += 1
            for ep in waiting | set(stopping):
                self._send(ep, P.Heartbeat(room=self._ping, sender=self.transport.session_id))
            for ep, rooms in stopping.items():
                for r in rooms:
                    self._send(ep, self._abort_msg(r, r.reason))
        for r in list(self._rooms.values()):
            if r.state in TERMINAL:
                continue
            if r.closing_since is not None:
                if self._quiet(r) or now - r.closing_since > cfg.quiesce_s:
                    self._finish_fail(r)
                continue
            if now > r.deadline:
                self._begin_fail(r.room, f"deadline exceeded in state {r.state.name}", code="timeout", notify=True)
                continue
            for ep, s in list(r.peers.items()):
                if s is PeerState.PENDING and now - self._peers_seen.get(ep, now) > cfg.peer_timeout_s:
                    if self.channel.reached(ep):
                        state, why = PeerState.STOPPING, ""  # silent: stopped, partitioned or dead, we cannot tell
                    else:  # never connected: our request never left this process, and now never will
                        self.channel.discard(ep)
                        state, why = PeerState.FAILED, " (never connected: our request never reached it)"
                    with self._lock:
                        r.peers[ep] = state
                    refused = self._refusals.get(ep)
                    if refused:  # it answers, but not with our key: say so, not just "unreachable"
                        why += f" ({refused})"
                    self._begin_fail(r.room, f"prefill peer {ep} unreachable for {cfg.peer_timeout_s:.1f} s{why}",
                                     code="peer_gone", notify=True)
                    self._advance(r)
                    break

    def _abort_msg(self, r: _RecvRoom, reason: str) -> P.Abort:
        return P.Abort(room=r.room, reason=(reason or "aborted by decode")[:4000], attempt=r.attempt)

    def _succeed(self, r: _RecvRoom) -> None:
        with self._lock:
            if r.state in TERMINAL:
                return
            r.state = RoomState.SUCCESS
            r.record.finished, r.record.result = time.monotonic(), "success"
        self._free_staging(r)
        r.lease.release(True)
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(r.record)
        r.done.set()

    def _begin_fail(self, room: int, reason: str, *, code: str, notify: bool) -> None:
        """Start failing: tell the senders, then wait for them to stop writing."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state in TERMINAL or r.closing_since is not None:
                return
            r.closing_since, r.reason, r.code = time.monotonic(), reason, code
            r.record.result = "aborted" if code == "aborted" else "failed"
            r.record.reason = reason
        log.warning("receiver: room %s failing: %s", room, reason)
        if notify:
            for ep, s in list(r.peers.items()):
                if s in (PeerState.PENDING, PeerState.STOPPING):
                    self._send(ep, self._abort_msg(r, reason))

    def _finish_fail(self, r: _RecvRoom) -> None:
        """The room reports Failed: its blocks go back now if every sender is quiet, else
        they are quarantined until the last one is."""
        with self._lock:
            if r.state in TERMINAL:
                return
            r.state = RoomState.FAILED
            r.record.finished = time.monotonic()
            quiet = self._quiet(r)
            if not quiet:
                loud = [ep for ep, s in r.peers.items() if s not in (PeerState.DONE, PeerState.FAILED)]
                r.quarantine = (",".join(loud)[:200], r.code or "failed", int(r.lease.blocks.size))
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(r.record)
        if quiet:
            self._free_staging(r)
            r.lease.release(False)
        else:
            peer, reason, n = r.quarantine
            self.metrics.child(self.metrics.quarantined, self.role, peer, reason).inc(n)
            self.metrics.child(self.metrics.quarantines, self.role, reason).inc()
            log.warning("receiver: room %s quarantined: %d block(s) kept from the engine until %s is proven quiet "
                        "(%s)", r.room, n, peer, r.reason)
        r.done.set()

    def _release_quarantine(self, r: _RecvRoom) -> None:
        """Every sender of a quarantined room is now proven quiet: its blocks go back."""
        with self._lock:
            q, r.quarantine = r.quarantine, None
        if q is None:
            return
        self._free_staging(r)
        if r.lease.release(False):
            self.metrics.child(self.metrics.quarantined, self.role, q[0], q[1]).dec(q[2])
            log.warning("receiver: room %s released from quarantine after %.2f s: %s proven quiet", r.room,
                        time.monotonic() - (r.record.finished or time.monotonic()), q[0])
        with self._lock:
            if r.forgotten and self._rooms.get(r.room) is r:
                del self._rooms[r.room]
