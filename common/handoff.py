"""Sender and receiver state machines for moving one request's KV (one "room").

Decode side (``KVReceiver``): allocates blocks for a room, sends each prefill rank that
holds part of the request a ``TransferRequest`` (its layout, block ids, the tokens it
already holds, its transfer-engine session, an auth tag), and waits for ``TransferDone``
from every one of them. Prefill side (``KVSender``): takes the request on its control
endpoint, checks it (version, auth, model and layout compatibility, that every byte it
would write lies inside the blocks the receiver allocated for that room), and as each
prefill chunk's KV is ready plans and writes it through the Mooncake transport,
gathering into a staging ring overlapped with the writes when the layouts differ.

Room states are ordered like SGLang's ``KVPoll`` (Failed < Bootstrapping < Waiting <
Transferring < Success), so the minimum over ranks is the request's state. Every room
has a deadline; both sides heartbeat; ``abort`` works from either side. Each side's
blocks for a room are released exactly once (``BlockLease``). A receiver that gives up
while its sender may still be writing reports Failed only after the sender
acknowledged, died, or ``quiesce_s`` passed, so its blocks are not reused under a write.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgspec
import numpy as np
import torch

from kvbridge.layout import (
    CopySpec,
    HeadMap,
    KVLayout,
    LayoutError,
    PlanCosts,
    PlanKind,
    TransferPlan,
    block_ranges,
    check_compatible,
    check_segments_inside,
    plan_transfer,
)
from kvbridge.layout.repack import Gather, Scatter

from . import protocol as P
from .blocks import BlockLease
from .control import ControlChannel
from .metrics import HandoffRecord, KVBridgeMetrics
from .transport import MooncakeTransport, TransportError

__all__ = ["RoomState", "KVSender", "KVReceiver", "HandoffConfig", "default_metrics"]

log = logging.getLogger(__name__)


class RoomState(enum.IntEnum):
    """Where a room is; ordered so that the minimum over ranks is the request's state."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    TRANSFERRING = 3
    SUCCESS = 4


TERMINAL = (RoomState.FAILED, RoomState.SUCCESS)
MAX_EARLY_ROOMS = 4096  # requests for rooms a sender has not registered yet, at most (then refused)
MAX_PEER_LAYOUTS = 256  # decode peers whose parsed layout a sender keeps


@dataclass(frozen=True)
class HandoffConfig:
    """Knobs shared by both sides (seconds unless named otherwise)."""

    deadline_s: float = 60.0  # a room must finish within this after it starts
    heartbeat_s: float = 1.0  # receivers ping the senders they wait on this often
    peer_timeout_s: float = 10.0  # a peer silent this long is gone; its rooms fail (a busy prefill can be slow to answer)
    quiesce_s: float = 1.0  # how long a failing receiver waits for its sender to stop writing
    chunk_bytes: int = 16 << 20  # a sender prepares the gather of this much payload at a time
    part_bytes: int = 4 << 20  # one gather + one write of a staged send (the ring's region size)
    ring_parts: int = 8  # regions of a sender worker's staging ring: parts gathered ahead of the wire
    first_part_bytes: int = 1 << 20  # the first part of a send; parts double up to part_bytes
    inline_gather: bool = False  # CPU pools: True keeps every gather on its send worker; False only parts up to 1 MiB
    prestage_slots: int = 8  # sender: rooms whose first part it may hold gathered before their request comes (0: never)
    prestage_bytes: int = 4 << 20  # that first part (one slot of the sender's prestage buffer)
    write_timeout_s: float = 30.0  # bound on one chunk's write
    secret: str = ""  # shared secret for auth tags; empty: auth off
    model: str = ""  # model name both sides must agree on (empty: not checked)
    kinds: tuple[PlanKind, ...] = (PlanKind.DIRECT, PlanKind.STAGED_SEND, PlanKind.STAGED_RECV)
    costs: PlanCosts = field(default_factory=PlanCosts)
    recv_staging_bytes: int = 0  # receiver: staging it offers senders (staged_recv plans); 0: none


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


@dataclass
class _Chunk:
    blocks: np.ndarray
    first_token: int
    start: int
    stop: int
    last: bool
    aux: dict | None = None


@dataclass
class _Target:
    """One decode rank pulling a sender room: its request and how far it has been served."""

    peer: str
    request: P.TransferRequest
    remote: KVLayout
    allowed: np.ndarray
    blocks: np.ndarray  # the receiver's block ids for the room, in token order
    sent: int = 0  # chunks of the room already written to this target
    staged_bytes: int = 0  # bytes written into the receiver's staging so far
    bytes: int = 0  # payload written to this target
    segments: int = 0
    staged: list = field(default_factory=list)  # P.StagedChunk per staged_recv chunk


@dataclass
class _SendRoom:
    room: int
    deadline: float
    record: HandoffRecord
    lease: BlockLease | None = None
    state: RoomState = RoomState.BOOTSTRAPPING
    targets: dict[str, _Target] = field(default_factory=dict)
    expected: int = 1  # decode ranks that will pull this room (TP fan-out)
    chunks: list[_Chunk] = field(default_factory=list)
    busy: bool = False
    reason: str = ""
    plan: TransferPlan | None = None  # the latest chunk's plan; the record takes its reason when the room ends
    prestaged: "_Prestaged | None" = None  # its first part, gathered before any request came
    prestage_tried: bool = False

    def note_plan_reason(self) -> None:
        """Put the latest plan's explanation into the record (built off the send's critical path)."""
        if self.plan is not None and not self.record.plan_reason:
            self.record.plan_reason = self.plan.explain()


@dataclass(frozen=True)
class _Prestaged:
    """A room's first staged part, gathered after its last chunk and before any request
    came, for ``remote`` (the layout of the decode peer served last) and the request an
    engine usually sends: every token ``[0, chunk.stop)``, into ascending block ids.

    Valid for a request that matches: a staged send's staging rows are in the
    destination's address order, which block ids change only through their order (and
    a shift of all addresses not at all), so any ascending block list of any peer whose
    layout has ``remote``'s ``relative_key`` gives the same rows as ``remote``'s first
    ``nblk`` blocks (and ``gather`` goes on with the rest of the first chunk's rows)."""

    chunk: _Chunk
    remote: KVLayout
    gather: Gather  # of the plan's first chunk, its index built for rows [0, rows)
    nblk: int  # destination blocks the request needs
    nbytes: int  # the whole plan's payload
    rows: int  # staging rows gathered: rows [0, rows) of the plan's first chunk
    slot: int  # which slot of the sender's prestage buffer holds them
    addr: int  # where it starts


class _Side:
    """What both sides share: layout, transport, control channel, rooms and deadlines."""

    role = ""

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, config: HandoffConfig | None,
                 metrics: KVBridgeMetrics | None, bind_host: str | None):
        self.layout = layout
        self.transport = transport
        self.config = config or HandoffConfig()
        self.metrics = metrics or default_metrics()
        self._lock = threading.RLock()
        self._peers_seen: dict[str, float] = {}
        self.channel = ControlChannel(self._on_frame, self._on_tick, bind_host=bind_host,
                                      name=f"kvbridge-{self.role}")

    def _count_blocks(self, n: int) -> None:
        self.metrics.child(self.metrics.blocks_held, self.role).inc(n)

    def _send(self, peer: str, msg) -> None:
        if isinstance(msg, (P.TransferFailed, P.Abort)) and len(msg.reason) > 4000:
            msg = msgspec.structs.replace(msg, reason=msg.reason[:3990] + " [...]")
        self.channel.send(peer, P.encode(msg))

    def _on_frame(self, peer: str, payload: bytes) -> None:
        self._peers_seen[peer] = time.monotonic()
        try:
            msg = P.decode(payload)
        except P.ProtocolError as e:
            log.warning("%s: refused a malformed control message from %s: %s", self.role, peer, e)
            self._send(peer, P.TransferFailed(room=0, reason=f"malformed message: {e}", code="bad_message"))
            return
        self._on_message(peer, msg)

    def _on_message(self, peer: str, msg) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _on_tick(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        """Stop the control channel (rooms still open fail)."""
        self.channel.close()


class KVSender(_Side):
    """Prefill side of one rank: serves TransferRequests for its rooms.

    Called by the prefill engine: ``add_room`` when a request is admitted (with the
    blocks it holds, and how to release them), ``send_chunk`` after each prefill chunk
    with the blocks and token range just computed, ``poll``/``abort``; the decode side
    reaches it at ``endpoint``.
    """

    role = "sender"

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, *, host: str = "127.0.0.1",
                 config: HandoffConfig | None = None, metrics: KVBridgeMetrics | None = None, workers: int = 2):
        self._rooms: dict[int, _SendRoom] = {}
        self._early: dict[int, dict[str, tuple[P.TransferRequest, float]]] = {}  # room -> peer -> (request, when)
        self._declined: dict[int, tuple[str, float]] = {}  # room -> (reason, when): declined before add_room
        self._peer_layouts: dict[str, tuple[bytes, KVLayout]] = {}  # peer -> its last layout (encoded description, parsed)
        self._last_pull: tuple[KVLayout, bool] | None = None  # the last decode layout served, and if its plan was staged_send
        super().__init__(layout, transport, config, metrics, bind_host=host)
        if not self.config.secret and host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("sender: control endpoint %s takes unauthenticated requests (no shared secret, e.g. "
                        "KVBRIDGE_SECRET): anyone who reaches it can have this rank's KV written to a Mooncake "
                        "session of their choice; see docs/security.md", self.endpoint)
        cfg = self.config
        for t in layout.tensors or ():
            transport.register_tensor(t)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-send")
        self._rings: deque = deque()
        for _ in range(workers):
            ring = torch.empty(max(2, cfg.ring_parts) * cfg.part_bytes, dtype=torch.uint8, device=layout.device or "cpu")
            transport.register_tensor(ring)
            self._rings.append(ring)
        # first parts gathered ahead of their requests (see _prestage): one slot per room
        self._slot_bytes = max(0, cfg.prestage_bytes)
        self._prestage_free: deque = deque(range(max(0, cfg.prestage_slots) if self._slot_bytes else 0))
        self._prestage_buf = None
        if self._prestage_free:
            self._prestage_buf = torch.zeros(len(self._prestage_free) * self._slot_bytes, dtype=torch.uint8,
                                             device=layout.device or "cpu")  # touched now: no page faults on a room's time
            transport.register_tensor(self._prestage_buf)

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
            r = _SendRoom(room, time.monotonic() + (deadline_s or self.config.deadline_s), rec)
            r.lease = BlockLease(room, blocks, release, self._count_blocks)
            self._rooms[room] = r
            self.metrics.child(self.metrics.inflight, self.role).inc()
            early = self._early.pop(room, {})
            declined = self._declined.pop(room, None)
        if declined is not None:  # the decode side decided to compute this prompt itself (or gave it up)
            self._fail(room, f"declined by decode: {declined[0]}", code="declined", notify=False)
            for peer in early:
                self._refuse(peer, room, f"room {room} was declined by a decode rank", "room_failed")
            return
        for peer, (req, _) in early.items():  # every decode rank that asked before the room existed
            self._accept(peer, req)

    def send_chunk(self, room: int, blocks, start: int, stop: int, *, last: bool, first_token: int = 0,
                   aux: dict | None = None) -> None:
        """Prefill engine, after a chunk: tokens ``[start, stop)`` of ``room`` are in ``blocks``
        (a block list in token order whose entry 0 holds token ``first_token``). With the
        last chunk, ``aux`` (e.g. ``{"output_ids": [first_token_id]}``) reaches the decode
        side in the same message that reports the KV landed."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                raise KeyError(f"room {room} is not on this sender")
            if r.state in TERMINAL:
                return
            if r.chunks and r.chunks[-1].last:
                raise ValueError(f"room {room}: chunk after the last one")
            r.chunks.append(_Chunk(np.asarray(blocks, dtype=np.int64), first_token, start, stop, last, aux))
        self._kick(r)

    def poll(self, room: int) -> RoomState:
        """The room's state (Failed for an unknown room)."""
        r = self._rooms.get(room)
        return r.state if r is not None else RoomState.FAILED

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
        """Drop a finished room's bookkeeping."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.state in TERMINAL and not r.busy:
                del self._rooms[room]

    def close(self) -> None:
        """Fail open rooms, stop workers and the control channel."""
        for room in list(self._rooms):
            if self._rooms[room].state not in TERMINAL:
                self._fail(room, "sender shutting down", code="shutdown", notify=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    # -- control plane (I/O thread) -----------------------------------------------------
    def _on_message(self, peer: str, msg) -> None:
        if isinstance(msg, P.TransferRequest):
            self._accept(peer, msg)
        elif isinstance(msg, P.Heartbeat):
            self._send(peer, P.Heartbeat(room=msg.room, sender=self.endpoint))
        elif isinstance(msg, P.Abort):
            self._on_abort(peer, msg)
        else:
            self._refuse(peer, msg.room, f"unexpected {type(msg).__name__} from a decode peer: a sender takes "
                         "transfer_request, heartbeat and abort", "bad_message")

    def _on_abort(self, peer: str, msg: P.Abort) -> None:
        """An Abort from a decode rank: from one pulling the room, it ends the room; from
        one that has not asked (or whose request waits for the room to exist), it declines
        the room: the decode side computes the prompt itself, so the room ends now (or as
        soon as the prefill engine adds it) and its blocks are released."""
        with self._lock:
            r = self._rooms.get(msg.room)
            target = r is not None and peer in r.targets
            asked = self._early.get(msg.room, {}).pop(peer, None) is not None
            if msg.room in self._early and not self._early[msg.room]:
                del self._early[msg.room]
        if target:
            self._fail(msg.room, f"aborted by decode: {msg.reason}", code="aborted", notify=True)
            return
        if self.config.secret and not asked and not P.verify(msg, self.config.secret):
            log.warning("sender: ignored an unauthenticated abort of room %s from %s", msg.room, peer)
            return
        if r is None:
            with self._lock:
                self._declined[msg.room] = (msg.reason, time.monotonic())
            self._send(peer, P.TransferFailed(room=msg.room, reason="abort acknowledged: room unknown", code="unknown_room"))
            return
        self._fail(msg.room, f"declined by decode: {msg.reason}", code="declined", notify=True)

    def _refuse(self, peer: str, room: int, reason: str, code: str) -> None:
        log.warning("sender: refused room %s from %s: %s", room, peer, reason)
        self._send(peer, P.TransferFailed(room=room, reason=reason, code=code))

    def _accept(self, peer: str, req: P.TransferRequest) -> None:
        cfg = self.config
        if cfg.secret and not P.verify(req, cfg.secret):
            self._refuse(peer, req.room, "authentication failed: bad or missing auth tag", "auth")
            return
        if cfg.model and req.model and req.model != cfg.model:
            self._refuse(peer, req.room, f"model mismatch: sender serves {cfg.model!r}, receiver {req.model!r}", "incompatible")
            self._fail(req.room, f"decode peer runs model {req.model!r}", code="incompatible", notify=False)
            return
        with self._lock:
            r = self._rooms.get(req.room)
            if r is None:
                if req.room not in self._early and len(self._early) >= MAX_EARLY_ROOMS:
                    self._refuse(peer, req.room, f"unknown room {req.room}: already {len(self._early)} requests wait "
                                 "for rooms this prefill has not registered", "unknown_room")
                    return
                self._early.setdefault(req.room, {})[peer] = (req, time.monotonic())
                return
            if r.state is RoomState.FAILED:
                self._refuse(peer, req.room, f"room {req.room} already failed: {r.reason}", "room_failed")
                return
            if peer in r.targets:
                return  # a duplicate (replayed) request changes nothing
            if len(r.targets) >= max(r.expected, req.receivers):
                self._refuse(peer, req.room, f"room already pulled by {len(r.targets)} decode rank(s)", "conflict")
                return
        try:
            remote = self._remote_layout(peer, req.layout)
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            if blocks.size and ((blocks < remote.first_block) | (blocks >= remote.num_blocks)).any():
                raise LayoutError("receiver block ids outside its own pool")
            if not 0 <= req.token_start < req.token_stop:
                raise LayoutError(f"empty token range [{req.token_start}, {req.token_stop})")
        except (LayoutError, ValueError, TypeError, OverflowError) as e:  # whatever a hostile layout triggers
            reason = f"incompatible layouts: {e}"
            self._refuse(peer, req.room, reason, "incompatible")
            self._fail(req.room, reason, code="incompatible", notify=True)
            return
        with self._lock:
            r.targets[peer] = _Target(peer, req, remote, block_ranges(remote, blocks), blocks)
            r.expected = max(r.expected, req.receivers)
            if r.state is RoomState.BOOTSTRAPPING:
                r.state = RoomState.WAITING
        self._kick(r)

    def _remote_layout(self, peer: str, desc: dict) -> KVLayout:
        """The decode peer's layout, checked against ours; a warm peer's is reused while it
        describes the same layout (raises LayoutError naming the mismatch)."""
        key = msgspec.msgpack.encode(desc)  # type-exact: 1, 1.0 and True differ here, not under ==
        known = self._peer_layouts.get(peer)
        if known is not None and known[0] == key:
            return known[1]
        remote = KVLayout.from_description(desc)
        check_compatible(self.layout, remote)
        with self._lock:
            self._peer_layouts.pop(peer, None)
            self._peer_layouts[peer] = (key, remote)
            while len(self._peer_layouts) > MAX_PEER_LAYOUTS:
                self._peer_layouts.pop(next(iter(self._peer_layouts)))
        return remote

    def _on_tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        for room, waiting in list(self._early.items()):
            for peer, (req, t) in list(waiting.items()):
                if now - t > cfg.deadline_s:
                    waiting.pop(peer, None)
                    self._refuse(peer, room, f"unknown room {room}: no prefill registered it within {cfg.deadline_s:.1f} s", "unknown_room")
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

    # -- data plane (workers) -----------------------------------------------------------
    def _next_work(self, r: _SendRoom) -> tuple[_Target, _Chunk] | None:
        for t in r.targets.values():
            if t.sent < len(r.chunks):
                return t, r.chunks[t.sent]
        return None

    def _kick(self, r: _SendRoom) -> None:
        with self._lock:
            if r.busy or r.state in TERMINAL or (self._next_work(r) is None and not self._prestage_due(r)):
                return
            r.busy = True
        self._pool.submit(self._drain, r)

    def _prestage_due(self, r: _SendRoom) -> bool:
        """Whether ``r``'s first part should be gathered now: its prompt is prefilled in one
        chunk, no decode rank has asked for it yet, the last one served got a staged send,
        and a slot is free. Call under the lock."""
        return (not r.prestage_tried and not r.targets and len(r.chunks) == 1 and r.chunks[0].last
                and r.chunks[0].start == 0 and self._last_pull is not None and self._last_pull[1]
                and bool(self._prestage_free))

    def _prestage(self, r: _SendRoom) -> None:
        """Send worker, after a room's last chunk when no request has come yet (TensorRT-LLM's
        order: the context finishes, then the generation side asks): gather its first part
        for the decode layout served last, so that a matching request has bytes on the
        wire without waiting for a gather (``_usable_prestage`` decides). Best effort."""
        with self._lock:
            if not self._prestage_due(r) or r.state in TERMINAL:
                return
            r.prestage_tried = True
            slot = self._prestage_free.pop()  # the slot freed last: still in cache
            remote, c = self._last_pull[0], r.chunks[0]
        cfg = self.config
        t0 = time.perf_counter()
        try:
            nblk = -(-c.stop // remote.tokens_per_block)
            if remote.first_block + nblk > remote.num_blocks:
                raise LayoutError(f"{c.stop} tokens need more blocks than the decode pool has")
            plan = plan_transfer(self.layout, c.blocks, remote, np.arange(remote.first_block, remote.first_block + nblk),
                                 (0, c.stop), src_first_token=c.first_token, dst_first_token=0,
                                 kinds=tuple(k for k in cfg.kinds if k is not PlanKind.STAGED_RECV), costs=cfg.costs)
            if plan.kind is not PlanKind.STAGED_SEND:
                raise LayoutError(f"a {plan.kind.value} plan has nothing to gather")
            gather = plan.chunks(cfg.chunk_bytes)[0].gather()
            rb = gather.row_bytes
            limit = min(gather.rows, max(1, self._slot_bytes // rb))
            step = max(1, min(cfg.first_part_bytes, self._slot_bytes) // rb)
            buf = self._prestage_buf[slot * self._slot_bytes:]
            rows = 0
            while rows < limit:  # a step at a time: a request that comes meanwhile takes what is ready
                b = min(limit, rows + step)
                gather.run(buf[rows * rb:], rows=(rows, b), inline=True)
                rows = b
                if r.targets or r.state in TERMINAL or self.channel.pending():  # perhaps its request: serve it
                    break
        except Exception as e:  # never fails the room: the request is served the usual way
            if isinstance(e, (LayoutError, ValueError)):
                log.debug("sender: room %s not prestaged: %s", r.room, e)
            else:
                log.exception("sender: prestaging room %s failed", r.room)
            with self._lock:
                self._prestage_free.append(slot)
            return
        with self._lock:
            r.prestaged = _Prestaged(c, remote, gather, nblk, plan.nbytes, rows, slot, buf.data_ptr())
            r.record.repack_s += time.perf_counter() - t0

    def _usable_prestage(self, r: _SendRoom, t: _Target, c: _Chunk, plan: TransferPlan) -> _Prestaged | None:
        """``r``'s prestaged first part if it is exactly the start of what ``plan`` would
        gather for target ``t`` (else it is given up)."""
        pre = r.prestaged
        if pre is None:
            return None
        req = t.request
        if (plan.kind is PlanKind.STAGED_SEND and pre.chunk is c and req.token_start == 0
                and (pre.remote is t.remote or pre.remote.relative_key == t.remote.relative_key)
                and req.first_token == 0 and req.token_stop == c.stop and plan.nbytes == pre.nbytes
                and t.blocks.size >= pre.nblk and bool(np.all(t.blocks[1:pre.nblk] > t.blocks[:pre.nblk - 1]))):
            return pre
        self._drop_prestage(r, used=False)
        return None

    def _drop_prestage(self, r: _SendRoom, *, used: bool) -> None:
        """Give the room's prestage slot back (once, whoever calls first), when no write
        can still read it."""
        with self._lock:
            pre, r.prestaged = r.prestaged, None
            if pre is None:
                return
            self._prestage_free.append(pre.slot)
        self.metrics.child(self.metrics.prestaged, "used" if used else "unused").inc()

    def _drain(self, r: _SendRoom) -> None:
        ring = self._rings.popleft()
        try:
            self._prestage(r)
            while True:
                with self._lock:
                    work = self._next_work(r) if r.state not in TERMINAL else None
                    if work is None:
                        break
                    r.state = RoomState.TRANSFERRING
                target, chunk = work
                self._send_one(r, target, chunk, ring)
                with self._lock:
                    if r.state in TERMINAL:  # aborted or failed while writing: no TransferDone for it
                        break
                    target.sent += 1
                    done = P.TransferDone(
                        room=r.room, bytes=target.bytes, segments=target.segments, plan=r.record.plan,
                        seconds=r.record.seconds, aux=chunk.aux or {}, staged=target.staged,
                        src_layout=self.layout.describe() if target.staged else {}) if chunk.last else None
                    complete = (len(r.targets) >= r.expected and r.chunks and r.chunks[-1].last
                                and all(t.sent == len(r.chunks) for t in r.targets.values()))
                if done is not None:  # the decode side waits on it: out before our own bookkeeping
                    self._send(target.peer, done)
                if complete:
                    self._succeed(r)
        except (TransportError, LayoutError, HandoffFailed) as e:
            with self._lock:
                r.busy = False
            self._fail(r.room, str(e), code="transfer", notify=True)
        except Exception as e:  # never leave a room hanging on a bug
            log.exception("sender: room %s crashed", r.room)
            with self._lock:
                r.busy = False
            self._fail(r.room, f"internal error: {e!r}", code="internal", notify=True)
        finally:
            self._rings.append(ring)
            if r.state in TERMINAL:
                self._drop_prestage(r, used=False)
            with self._lock:
                r.busy = False
        self._kick(r)

    def _send_one(self, r: _SendRoom, t: _Target, c: _Chunk, ring: torch.Tensor) -> None:
        req = t.request
        start, stop = max(c.start, req.token_start), min(c.stop, req.token_stop)
        if c.last and c.stop != req.token_stop:
            raise HandoffFailed(f"prefill has {c.stop} tokens but decode expects {req.token_stop}")
        if stop <= start:
            return
        cfg = self.config
        # receiver staging is an option only while this chunk's payload still fits in it
        lay = self.layout
        payload = lay.num_layers * lay.kv_factor * (stop - start) * HeadMap.between(lay, t.remote).count * lay.head_bytes
        fits = payload <= req.staging_bytes - t.staged_bytes
        kinds = tuple(k for k in cfg.kinds if k is not PlanKind.STAGED_RECV or fits)
        t_plan = time.perf_counter()
        plan = plan_transfer(lay, c.blocks, t.remote, req.block_ids, (start, stop),
                             src_first_token=c.first_token, dst_first_token=req.first_token,
                             kinds=kinds, costs=cfg.costs)
        rec = r.record
        rec.plan_s += time.perf_counter() - t_plan
        rec.plan, rec.plan_reason, r.plan = plan.kind.value, "", plan
        # what the next room may be prestaged for: this layout, if this request had the usual shape
        self._last_pull = (t.remote, plan.kind is PlanKind.STAGED_SEND and req.token_start == 0 and req.first_token == 0)
        deadline = min(r.deadline - time.monotonic(), cfg.write_timeout_s)
        if plan.kind is PlanKind.STAGED_RECV:
            # into the staging this receiver set aside for this sender, after what is there
            base = req.staging_addr + t.staged_bytes
            wire = plan.wire.shifted(dst_by=base)
            allowed = np.array([[req.staging_addr, req.staging_addr + req.staging_bytes]], dtype=np.int64)
        else:
            wire, allowed = plan.wire, t.allowed
        # the guard: not one byte outside what this receiver set aside for this room
        check_segments_inside(wire.dst, wire.length, allowed, f"room {r.room}")
        if plan.kind is PlanKind.STAGED_SEND:
            pre = self._usable_prestage(r, t, c, plan)
            try:
                self._pipeline(r, t.peer, req.session, plan, ring, deadline, pre)
            finally:
                if pre is not None:  # every write that read it has settled
                    self._drop_prestage(r, used=True)
        else:
            self._drop_prestage(r, used=False)
            t0 = time.perf_counter()
            h = self.transport.write_async(req.session, wire.src, wire.dst, wire.length, deadline,
                                           guard=functools.partial(self._stop_reason, r, t.peer))
            try:
                self._await(r, h, peer=t.peer, last=True)
            finally:
                self._settle_write(h)
            rec.transfer_s += time.perf_counter() - t0
            rec.chunks += 1
        if plan.kind is PlanKind.STAGED_RECV:
            t.staged.append(P.StagedChunk(first_token=c.first_token, start=start, stop=stop, offset=t.staged_bytes,
                                          blocks=c.blocks.tolist()))
            t.staged_bytes += plan.nbytes
        rec.bytes += plan.nbytes
        rec.segments += plan.num_segments
        t.bytes += plan.nbytes
        t.segments += plan.num_segments

    def _pipeline(self, r: _SendRoom, peer: str, session: str, plan, ring: torch.Tensor, deadline_s: float,
                  pre: _Prestaged | None = None) -> None:
        """Staged send: gather the plan into the staging ring part by part, each part written
        as soon as it is gathered. Parts start at ``first_part_bytes`` and double up to
        ``part_bytes`` (bytes are on the wire after a tiny gather); a region of the ring is
        gathered into again only once the write that read it has completed, so up to
        ``ring_parts`` writes are in flight while the next part is gathered. No part is
        submitted once the decode peer has been silent for ``peer_timeout_s`` (it gives the
        room up then; e.g. this process was stopped and has just resumed). With ``pre``, the
        first part was gathered before the request came and goes out first."""
        cfg, rec = self.config, r.record
        regions = ring.numel() // cfg.part_bytes
        inflight: deque = deque()
        end = time.monotonic() + deadline_s
        want = cfg.first_part_bytes
        k = 0
        guard = functools.partial(self._stop_reason, r, peer)
        try:
            for i, chunk in enumerate(plan.chunks(cfg.chunk_bytes)):
                a = 0
                if i == 0 and pre is not None and pre.gather.nbytes != chunk.nbytes:
                    log.error("sender: room %s: prestaged part does not fit its first chunk; not used", r.room)
                    pre = None
                if i == 0 and pre is not None:
                    t0 = time.perf_counter()
                    pre_bytes = pre.rows * pre.gather.row_bytes
                    w = chunk.wire.window(0, pre_bytes).shifted(src_by=pre.addr)
                    inflight.append(self.transport.write_async(session, w.src, w.dst, w.length, end - time.monotonic(),
                                                               guard=guard))
                    rec.transfer_s += time.perf_counter() - t0
                    rec.chunks += 1
                    k, a, want = k + 1, pre.rows, max(want, pre_bytes)
                t0 = time.perf_counter()
                # builds each part's row index as that part is gathered
                gather = pre.gather if i == 0 and pre is not None else chunk.gather()
                rec.repack_s += time.perf_counter() - t0
                rb = gather.row_bytes
                while a < gather.rows:
                    why = self._stop_reason(r, peer)
                    if why:
                        raise HandoffFailed(why)
                    b = min(gather.rows, a + max(1, min(want, cfg.part_bytes) // rb))
                    want *= 2
                    if len(inflight) == regions:  # the region we are about to reuse must be sent
                        t0 = time.perf_counter()
                        self._await(r, inflight[0], end - time.monotonic(), peer)
                        inflight.popleft()
                        rec.transfer_s += time.perf_counter() - t0
                    region = ring[(k % regions) * cfg.part_bytes:]
                    t0 = time.perf_counter()
                    gather.run(region, rows=(a, b), inline=True if cfg.inline_gather else None)
                    rec.repack_s += time.perf_counter() - t0
                    t0 = time.perf_counter()  # submitting the part's write counts as transfer time
                    w = chunk.wire.window(a * rb, b * rb).shifted(src_by=region.data_ptr())
                    inflight.append(self.transport.write_async(session, w.src, w.dst, w.length, end - time.monotonic(),
                                                               guard=guard))
                    rec.transfer_s += time.perf_counter() - t0
                    rec.chunks += 1
                    k, a = k + 1, b
            t0 = time.perf_counter()
            while inflight:
                self._await(r, inflight[0], end - time.monotonic(), peer, last=len(inflight) == 1)
                inflight.popleft()
            rec.transfer_s += time.perf_counter() - t0
        finally:
            for h in inflight:  # on failure: no piece of ours may still be in the engine
                self._settle_write(h)

    def _await(self, r: _SendRoom, h, timeout_s: float | None = None, peer: str | None = None,
               last: bool = False) -> None:
        """Wait for write ``h``, giving it up as soon as the room ends (an abort from either
        side, a peer gone) or ``peer`` has been silent for ``peer_timeout_s`` (checked
        before each poll, which may submit more pieces): nothing more of it may land in the
        peer's blocks after that. Sleeps between polls double up to 1 ms, or only up to
        the transport's short cap once ``h`` is the ``last`` write of the room and only
        its last piece is left (then the room's end waits on it)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        sleep = 50e-6
        while True:
            why = self._stop_reason(r, peer)
            if why:
                raise HandoffFailed(why)
            if h.poll():
                return
            if end is not None and time.monotonic() > end:
                h.wait(1e-6)  # raises TransportTimeout unless it just completed
                return
            time.sleep(sleep)
            sleep = min(2 * sleep, h.sleep_cap() if last else 1e-3)

    def _stop_reason(self, r: _SendRoom, peer: str | None) -> str | None:
        """Why no further piece of room ``r`` may go to ``peer`` (None: it may): the room
        ended, or the peer has been silent longer than ``peer_timeout_s``, so it has given
        the room up and may reuse its blocks (e.g. this process was stopped and has just
        resumed). Asked before each gather and, as the transport's write guard, right
        before each piece is handed to the engine."""
        if r.state in TERMINAL:
            return f"room {r.room} ended during the transfer: {r.reason}"
        if peer is not None:
            silent = time.monotonic() - self._peers_seen.get(peer, time.monotonic())
            if silent > self.config.peer_timeout_s:
                return (f"decode peer silent for {silent:.1f} s (> {self.config.peer_timeout_s:.1f} s): "
                        "it has given the room up; no more writes into its blocks")
        return None

    def _settle_write(self, h) -> None:
        """After a write ended (or to end it): make sure the engine holds none of its pieces,
        so our staging slot and the peer's blocks may be reused."""
        if not h.done:
            h.abort("room failed")
        if not h.settle(self.config.write_timeout_s):
            log.error("sender: pieces of a failed write are still in the transfer engine after %.1f s",
                      self.config.write_timeout_s)

    def _succeed(self, r: _SendRoom) -> None:
        with self._lock:
            if r.state in TERMINAL:
                return
            r.note_plan_reason()
            r.state = RoomState.SUCCESS
            rec = r.record
            rec.finished, rec.result = time.monotonic(), "success"
        self._drop_prestage(r, used=False)
        r.lease.release(True)
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(rec)

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
        if busy:  # tell the peer and release only once no write of ours can still land
            threading.Thread(target=self._settle_when_idle, args=(r, notify, code), daemon=True).start()
        else:
            self._settle(r, notify, code)

    def _settle(self, r: _SendRoom, notify: bool, code: str) -> None:
        if notify:
            for peer in r.targets:
                self._send(peer, P.TransferFailed(room=r.room, reason=r.reason, code=code))
        if not r.busy:  # else the worker gives it back once its writes settled
            self._drop_prestage(r, used=False)
        r.lease.release(False)

    def _settle_when_idle(self, r: _SendRoom, notify: bool, code: str) -> None:
        end = time.monotonic() + self.config.write_timeout_s + 1
        while r.busy and time.monotonic() < end:
            time.sleep(0.002)
        self._settle(r, notify, code)


class _Arena:
    """First-fit allocator of byte ranges in one registered staging buffer."""

    def __init__(self, size: int, align: int = 256):
        self.size, self.align = size, align
        self._free: list[tuple[int, int]] = [(0, size)] if size else []
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = -(-n // self.align) * self.align
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= n:
                    self._free[i] = (off + n, ln - n)
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        n = -(-n // self.align) * self.align
        with self._lock:
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                elif ln:
                    merged.append((o, ln))
            self._free = merged


@dataclass
class _RecvRoom:
    room: int
    deadline: float
    record: HandoffRecord
    lease: BlockLease
    peers: dict[str, str]  # endpoint -> "pending" | "done" | "failed"
    first_token: int = 0
    need_bytes: int = 0  # what this room's tokens and heads take: the senders' Done must account for it
    staging: dict[str, tuple[int, int]] = field(default_factory=dict)  # endpoint -> (offset, bytes)
    state: RoomState = RoomState.BOOTSTRAPPING
    reason: str = ""
    closing_since: float | None = None
    aux: dict = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


class KVReceiver(_Side):
    """Decode side of one rank: pulls rooms from prefill senders into its own blocks.

    Called by the decode engine: ``request`` once blocks are allocated, ``poll`` until
    Success or Failed, ``abort`` to give up. ``release`` passed to ``request`` gets the
    blocks back exactly once: with True when they hold the KV, False when they are free.
    """

    role = "receiver"

    def __init__(self, layout: KVLayout, transport: MooncakeTransport, *, config: HandoffConfig | None = None,
                 metrics: KVBridgeMetrics | None = None):
        self._rooms: dict[int, _RecvRoom] = {}
        self._declined: deque = deque(maxlen=4096)  # rooms declined lately (their acks are expected)
        self._last_ping = 0.0
        self._layout_desc = layout.describe()  # what every request carries (the layout never changes)
        super().__init__(layout, transport, config, metrics, bind_host=None)
        for t in layout.tensors or ():
            transport.register_tensor(t)
        n = self.config.recv_staging_bytes
        self._arena = _Arena(n)
        self._staging = None
        if n:
            self._staging = torch.empty(n, dtype=torch.uint8, device=layout.device or "cpu")
            transport.register_tensor(self._staging)
        self._scatter_pool = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-scatter")

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
        try:  # validate everything before the room exists, so a bad request leaks nothing
            base = P.TransferRequest(
                room=room, model=self.config.model, layout=self._layout_desc, block_ids=ids.tolist(),
                first_token=first_token, token_start=start, token_stop=stop, session=self.transport.session_id,
                sent_at=time.time(), receivers=receivers,
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
                          {ep: "pending" for ep in eps})
            self._rooms[room] = r
            self.metrics.child(self.metrics.inflight, self.role).inc()
        r.first_token = first_token
        r.need_bytes = (stop - start) * self.layout.num_layers * self.layout.kv_factor * self.layout.token_bytes
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
            if self.config.secret:
                msg = P.sign(msg, self.config.secret)
            self._peers_seen[ep] = now  # a fresh request starts a fresh liveness window
            if msg is base:
                self.channel.send(ep, payload)
            else:
                self._send(ep, msg)
        with self._lock:
            if r.state is RoomState.BOOTSTRAPPING:
                r.state = RoomState.WAITING

    def poll(self, room: int) -> RoomState:
        """The room's state (Failed for an unknown room)."""
        r = self._rooms.get(room)
        return r.state if r is not None else RoomState.FAILED

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
        (an ``Abort``, signed when a secret is set), so it ends the room and releases its
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
        if self.config.secret:
            msg = P.sign(msg, self.config.secret)
        for ep in eps:
            self._send(ep, msg)
        rec = HandoffRecord(room=room, role=self.role, result="declined", reason=reason)
        rec.finished = rec.started
        self.metrics.observe(rec)
        self.metrics.fallbacks.labels(self.role, label).inc()
        log.info("receiver: room %s declined (%s): %s", room, label, reason)
        return rec

    def forget(self, room: int) -> None:
        """Drop a finished room's bookkeeping."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.state in TERMINAL:
                del self._rooms[room]

    def close(self) -> None:
        """Fail open rooms and stop the control channel."""
        for room in list(self._rooms):
            self._begin_fail(room, "receiver shutting down", code="shutdown", notify=True)
            self._finish_fail(self._rooms[room])
        self._scatter_pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    # -- control plane (I/O thread) -----------------------------------------------------
    def _on_message(self, peer: str, msg) -> None:
        if isinstance(msg, P.Heartbeat):
            return
        r = self._rooms.get(getattr(msg, "room", -1))
        if r is None or peer not in r.peers:
            if r is None and getattr(msg, "room", -1) in self._declined:
                return  # a prefill acknowledging a declined room
            if not isinstance(msg, P.Heartbeat):
                log.warning("receiver: %s for unknown room %s from %s", type(msg).__name__, getattr(msg, "room", "?"), peer)
            return
        if isinstance(msg, P.TransferDone):
            if msg.staged and r.closing_since is None:
                r.peers[peer] = "scattering"  # the sender is done writing; our scatter is not
                self._scatter_pool.submit(self._scatter, r, peer, msg)
                return
            self._peer_done(r, peer, msg)
        elif isinstance(msg, P.TransferFailed):
            with self._lock:
                r.peers[peer] = "failed"
            if r.closing_since is None:
                self._begin_fail(r.room, f"prefill {peer} failed the room: {msg.reason}", code=msg.code, notify=True)
            if self._quiet(r):
                self._finish_fail(r)
        elif isinstance(msg, P.Abort):
            with self._lock:
                r.peers[peer] = "failed"
            self._begin_fail(r.room, f"aborted by prefill: {msg.reason}", code="aborted", notify=True)
            if self._quiet(r):
                self._finish_fail(r)

    def _peer_done(self, r: _RecvRoom, peer: str, msg) -> None:
        with self._lock:
            r.peers[peer] = "done"
            r.record.bytes += msg.bytes
            r.record.segments += msg.segments
            r.record.plan = msg.plan
            r.aux.update(msg.aux)
            all_done = all(v == "done" for v in r.peers.values())
        if all_done and r.state not in TERMINAL and r.closing_since is None and r.record.bytes < r.need_bytes:
            # a sender counts what it wrote to every target of the room, so the sum is at least
            # this room's share; less is a peer claiming bytes it never wrote
            self._begin_fail(r.room, f"prefill peers reported {r.record.bytes} B written, but the room's tokens "
                             f"need {r.need_bytes} B", code="short_write", notify=True)
            if self._quiet(r):
                self._finish_fail(r)
        elif all_done and r.state not in TERMINAL and r.closing_since is None:
            self._succeed(r)
        elif r.closing_since is not None and self._quiet(r):
            self._finish_fail(r)

    def _scatter(self, r: _RecvRoom, peer: str, msg) -> None:
        """Move what a sender wrote into our staging to our blocks (staged_recv plans)."""
        try:
            if peer not in r.staging:
                raise LayoutError("sender used receiver staging that was not offered to it")
            off, size = r.staging[peer]
            src = KVLayout.from_description(msg.src_layout)
            t0 = time.perf_counter()
            for ch in msg.staged:
                spec = CopySpec.build(src, ch.blocks, self.layout, r.lease.blocks, (ch.start, ch.stop),
                                      src_first_token=ch.first_token, dst_first_token=r.first_token)
                if ch.offset + spec.nbytes > size:
                    raise LayoutError(f"staged chunk at {ch.offset} (+{spec.nbytes} B) overruns the {size} B offered")
                Scatter(spec).run(self._staging[off + ch.offset : off + ch.offset + spec.nbytes])
            r.record.repack_s += time.perf_counter() - t0
        except Exception as e:  # a sender's Done is input: whatever it triggers fails the room, with the reason
            if not isinstance(e, (LayoutError, ValueError)):
                log.exception("receiver: room %s: scatter of what %s staged crashed", r.room, peer)
            r.peers[peer] = "failed"
            self._begin_fail(r.room, f"cannot scatter what prefill {peer} staged: {e}", code="staging", notify=True)
            if self._quiet(r):
                self._finish_fail(r)
            return
        self._peer_done(r, peer, msg)

    def _free_staging(self, r: _RecvRoom) -> None:
        for off, n in r.staging.values():
            self._arena.free(off, n)
        r.staging.clear()

    def _quiet(self, r: _RecvRoom) -> bool:
        """No sender of this room can still be writing."""
        return all(v not in ("pending", "scattering") for v in r.peers.values())

    def _on_tick(self) -> None:
        now = time.monotonic()
        cfg = self.config
        if now - self._last_ping >= cfg.heartbeat_s:
            self._last_ping = now
            waiting = {ep for r in self._rooms.values() if r.state not in TERMINAL for ep, s in r.peers.items() if s == "pending"}
            for ep in waiting:
                self._send(ep, P.Heartbeat(room=0, sender=self.transport.session_id))
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
            for ep, s in r.peers.items():
                if s == "pending" and now - self._peers_seen.get(ep, now) > cfg.peer_timeout_s:
                    r.peers[ep] = "failed"  # gone: it cannot be writing any more
                    self._begin_fail(r.room, f"prefill peer {ep} unreachable for {cfg.peer_timeout_s:.1f} s",
                                     code="peer_gone", notify=True)
                    break
            if r.closing_since is not None and self._quiet(r):
                self._finish_fail(r)

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
            r.closing_since, r.reason = time.monotonic(), reason
            r.record.result = "aborted" if code == "aborted" else "failed"
            r.record.reason = reason
        log.warning("receiver: room %s failing: %s", room, reason)
        if notify:
            for ep, s in r.peers.items():
                if s == "pending":
                    self._send(ep, P.Abort(room=room, reason=reason))

    def _finish_fail(self, r: _RecvRoom) -> None:
        with self._lock:
            if r.state in TERMINAL:
                return
            r.state = RoomState.FAILED
            r.record.finished = time.monotonic()
        self._free_staging(r)
        r.lease.release(False)
        self.metrics.child(self.metrics.inflight, self.role).dec()
        self.metrics.observe(r.record)
        r.done.set()
