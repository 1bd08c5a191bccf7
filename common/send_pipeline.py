"""A sender's data plane: a send worker writes a room's chunks to each decode peer.

Per chunk and target: plan (``plan_transfer``: direct, staged_send or staged_recv by
estimated time; staged_both where neither side alone can stage), check every segment
against the blocks (or staging) that receiver set aside for the room (the write guard),
then write through the Mooncake transport. A ``staged_send`` (and a ``staged_both``)
gathers into the worker's staging ring part by part, each part on the wire while the next
is gathered. A room prefilled in one chunk before any decode asked may have its first
part gathered ahead (the *prestage*: TensorRT-LLM's order, the generation side asks once
the context is over), for the decode layout served last.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from kvbridge.layout import (MAX_UNITS, HeadMap, KVLayout, LayoutError, PlanKind, TransferPlan, check_segments_inside,
                             grid_for, kv_digest, plan_transfer)

from . import protocol as P
from .rooms import TERMINAL, HandoffFailed, RoomState
from .metrics import KVBridgeMetrics
from .send_rooms import Prestaged, SendChunk, SendRoom, SendTarget
from .copy_choice import copy_split, threads_taken
from .settings import HandoffConfig
from .staging import staging_buffer
from .transport import MooncakeTransport, TransportError, WriteHandle


__all__ = ["SendPipeline", "SenderSide"]

log = logging.getLogger(__name__)


def _continues(a: "SendChunk", b: "SendChunk") -> bool:
    """Whether piece ``b`` is the next layers of piece ``a``'s tokens, in the same blocks."""
    return (a.layers is not None and b.layers is not None and a.layers[1] == b.layers[0] and not a.last
            and (a.start, a.stop, a.first_token) == (b.start, b.stop, b.first_token)
            and (a.blocks is b.blocks or np.array_equal(a.blocks, b.blocks)))


def _shape_of_prestage(pre: "Prestaged | None", t: "SendTarget", c: "SendChunk") -> bool:
    """Whether target ``t``'s request for chunk ``c`` has the shape ``pre`` was gathered for:
    every token of ``c`` from the first, into a layout like the one prestaged for (its block
    order is checked apart, once the plan is made)."""
    req = t.request
    return (pre is not None and pre.chunk is c and req.token_start == 0 and req.first_token == 0
            and req.token_stop == c.stop
            and (pre.remote is t.remote or pre.remote.relative_key == t.remote.relative_key))


class SenderSide(Protocol):
    """What a send pipeline asks of its sender (``KVSender``). ``lock`` guards every room's
    ``state``, ``targets``, ``chunks``, ``busy`` and ``prestaged``, and the pipeline's
    prestage slots."""

    lock: threading.RLock

    def last_heard(self, peer: str) -> float | None:
        """When ``peer`` (a decode rank) was last heard from (``time.monotonic``), if ever."""

    def control_pending(self) -> bool:
        """Whether a control message waits to be handled (perhaps a room's request)."""

    def reply(self, peer: str, msg) -> None:
        """Send control message ``msg`` to ``peer``."""

    def succeed(self, r: SendRoom) -> None:
        """Room ``r`` was delivered to every decode rank that asked."""

    def fail(self, room: int, reason: str, code: str) -> None:
        """Room ``room`` failed (its decode ranks are told)."""

    def worker_done(self, r: SendRoom) -> None:
        """A send worker let go of ``r`` (``r.busy`` is False): forget it if it was
        forgotten meanwhile, and hand it a worker again if work is left."""


class SendPipeline:
    """A sender's send workers and what they own: the staging rings (one per worker), the
    prestage slots, the digest worker, the layer views. ``drain(r)`` runs on a send worker,
    one room per worker at a time; the room state it changes is taken under ``side.lock``;
    it reaches its sender only through ``side`` (``SenderSide``)."""

    def __init__(self, side: SenderSide, layout: KVLayout, transport: MooncakeTransport, config: HandoffConfig,
                 metrics: KVBridgeMetrics, workers: int):
        self.side, self.layout, self.transport, self.config, self.metrics = side, layout, transport, config, metrics
        self._lock = side.lock
        self._layout_desc = P.LayoutDescription.of(layout)  # what a staged_recv Done carries (src_layout)
        self._last_pull: tuple[KVLayout, bool] | None = None  # the last decode layout served, and if its plan was staged_send
        self._own_views: dict[tuple[int, int], KVLayout] = {}  # layer range -> our layout seen as those layers
        # content digests (integrity), taken beside the writes of the piece they describe
        self._digester = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-digest")
        # the gather's C copy over config.gather_threads threads (copy_choice: one beside TCP)
        self._split, self._split_pool = copy_split(config.gather_threads, "kvbridge-gather")
        self._rings: deque = deque()
        for _ in range(workers):
            ring = staging_buffer(max(2, config.ring_parts) * config.part_bytes, layout.device or "cpu")  # faulted in now
            transport.register_tensor(ring)
            self._rings.append(ring)
        self._own_staging = list(self._rings)  # registered here, unregistered at close
        # first parts gathered ahead of their requests (see _prestage): one slot per room
        self._slot_bytes = max(0, config.prestage_bytes)
        self.prestage_free: deque = deque(range(max(0, config.prestage_slots) if self._slot_bytes else 0))
        self._prestage_buf = None
        if self.prestage_free:
            self._prestage_buf = staging_buffer(len(self.prestage_free) * self._slot_bytes,
                                                layout.device or "cpu")  # touched now: no page faults on a room's time
            transport.register_tensor(self._prestage_buf)
            self._own_staging.append(self._prestage_buf)

    def close(self) -> None:
        """After the send workers stopped: stop the digest worker, and give back the
        staging's registration (nothing writes from it any more)."""
        self._digester.shutdown(wait=True, cancel_futures=True)
        if self._split_pool is not None:
            self._split_pool.shutdown(wait=True)
        if not self.transport.closed:
            for buf in self._own_staging:
                self.transport.unregister(buf.data_ptr())
        self._own_staging = []

    def next_work(self, r: "SendRoom") -> tuple["SendTarget", "SendChunk", int] | None:
        """The next chunk some target of ``r`` has not been served, and how many of the
        room's chunks it stands for: layer pieces of one token range that queued up (the
        decode asked late, or the wire is slower than the forward) go as one layer range,
        one plan and one pipeline instead of one per piece. Call under the lock."""
        for t in r.targets.values():
            if t.sent < len(r.chunks):
                c, n = r.chunks[t.sent], 1
                while t.sent + n < len(r.chunks) and _continues(r.chunks[t.sent + n - 1], r.chunks[t.sent + n]):
                    n += 1
                if n > 1:
                    tail = r.chunks[t.sent + n - 1]
                    lo, hi = c.layers[0], tail.layers[1] if tail.layers else self.layout.num_layers
                    whole = (lo, hi) == (0, self.layout.num_layers)
                    c = replace(c, last=tail.last, aux=tail.aux, layers=None if whole else (lo, hi))
                return t, c, n
        return None

    def prestage_due(self, r: "SendRoom") -> bool:
        """Whether ``r``'s first part should be gathered now: its prompt is prefilled in one
        chunk, no decode rank has asked for it yet, the last one served got a staged send,
        and a slot is free. Call under the lock."""
        return (not r.prestage_tried and not r.targets and len(r.chunks) == 1 and r.chunks[0].last
                and r.chunks[0].start == 0 and self._last_pull is not None and self._last_pull[1]
                and bool(self.prestage_free))

    def _prestage(self, r: "SendRoom") -> None:
        """Send worker, after a room's last chunk when no request has come yet (TensorRT-LLM's
        order: the context finishes, then the generation side asks): gather its first part
        for the decode layout served last, so that a matching request has bytes on the
        wire without waiting for a gather (``_usable_prestage`` decides). Best effort."""
        with self._lock:
            if not self.prestage_due(r) or r.state in TERMINAL:
                return
            r.prestage_tried = True
            slot = self.prestage_free.pop()  # the slot freed last: still in cache
            remote, c = self._last_pull[0], r.chunks[0]
        cfg = self.config
        t0 = time.perf_counter()
        try:
            nblk = -(-c.stop // remote.tokens_per_block)
            if remote.first_block + nblk > remote.num_blocks:
                raise LayoutError(f"{c.stop} tokens need more blocks than the decode pool has")
            plan = plan_transfer(self.layout, c.blocks, remote, np.arange(remote.first_block, remote.first_block + nblk),
                                 (0, c.stop), src_first_token=c.first_token, dst_first_token=0,
                                 kinds=tuple(k for k in cfg.kinds if not k.scatters), costs=cfg.costs)
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
                if r.targets or r.state in TERMINAL or self.side.control_pending():  # perhaps its request: serve it
                    break
        except Exception as e:  # never fails the room: the request is served the usual way
            if isinstance(e, (LayoutError, ValueError)):
                log.debug("sender: room %s not prestaged: %s", r.room, e)
            else:
                log.exception("sender: prestaging room %s failed", r.room)
            with self._lock:
                self.prestage_free.append(slot)
            return
        with self._lock:
            r.prestaged = Prestaged(c, remote, gather, nblk, plan.nbytes, rows, slot, buf.data_ptr())
            r.record.repack_s += time.perf_counter() - t0

    def _usable_prestage(self, r: "SendRoom", t: "SendTarget", c: "SendChunk", plan: TransferPlan) -> Prestaged | None:
        """``r``'s prestaged first part if it is exactly the start of what ``plan`` would
        gather for target ``t`` (else it is given up)."""
        pre = r.prestaged
        if pre is None:
            return None
        if (plan.kind is PlanKind.STAGED_SEND and _shape_of_prestage(pre, t, c) and plan.nbytes == pre.nbytes
                and t.blocks.size >= pre.nblk and bool(np.all(t.blocks[1:pre.nblk] > t.blocks[:pre.nblk - 1]))):
            return pre
        self.drop_prestage(r, used=False)
        return None

    def drop_prestage(self, r: "SendRoom", *, used: bool) -> None:
        """Give the room's prestage slot back (once, whoever calls first), when no write
        can still read it."""
        with self._lock:
            pre, r.prestaged = r.prestaged, None
            if pre is None:
                return
            self.prestage_free.append(pre.slot)
        self.metrics.child(self.metrics.prestaged, "used" if used else "unused").inc()

    def drain(self, r: "SendRoom") -> None:
        """Send worker (``KVSender._kick``, with ``r.busy`` set): serve room ``r``'s targets
        chunk by chunk until no work is left or the room ends, then hand it back
        (``SenderSide.worker_done``)."""
        ring = self._rings.popleft()
        try:
            self._prestage(r)
            while True:
                with self._lock:
                    work = self.next_work(r) if r.state not in TERMINAL else None
                    if work is None:
                        break
                    r.state = RoomState.TRANSFERRING
                target, chunk, pieces = work
                self._send_one(r, target, chunk, ring)
                with self._lock:
                    if r.state in TERMINAL:  # aborted or failed while writing: no TransferDone for it
                        break
                    target.sent += pieces
                    done = P.TransferDone(
                        room=r.room, bytes=target.bytes, segments=target.segments, plan=r.record.plan,
                        seconds=r.record.seconds, aux=chunk.aux or {}, staged=target.staged,
                        src_layout=self._layout_desc if target.staged else None,
                        layer_bytes=target.layer_bytes.tolist(), digest=target.digest,
                        digest_algorithm=target.digest_algorithm if target.digest else "",
                        attempt=target.request.attempt) \
                        if chunk.last else None
                    complete = (len(r.targets) >= r.expected and r.chunks and r.chunks[-1].last
                                and all(t.sent == len(r.chunks) for t in r.targets.values()))
                if done is not None:  # the decode side waits on it: out before our own bookkeeping
                    r.record.done_at = time.monotonic()
                    self.side.reply(target.peer, done)
                if complete:
                    self.side.succeed(r)
        # a failure fails the room while this worker still holds it (r.busy): no second
        # worker can start on it meanwhile, and the room is settled (told quiet) only once
        # this one let go, below
        except (TransportError, LayoutError, HandoffFailed) as e:
            self.side.fail(r.room, str(e), "transfer")
        except Exception as e:  # never leave a room hanging on a bug
            log.exception("sender: room %s crashed", r.room)
            self.side.fail(r.room, f"internal error: {e!r}", "internal")
        finally:
            self._rings.append(ring)
            if r.state in TERMINAL:
                self.drop_prestage(r, used=False)
            with self._lock:
                r.busy = False
        self.side.worker_done(r)

    def _send_one(self, r: "SendRoom", t: "SendTarget", c: "SendChunk", ring: torch.Tensor) -> None:
        req = t.request
        start, stop = max(c.start, req.token_start), min(c.stop, req.token_stop)
        if c.last and c.stop != req.token_stop:
            raise HandoffFailed(f"prefill has {c.stop} tokens but decode expects {req.token_stop}")
        if stop <= start:
            return
        cfg = self.config
        lo, hi = c.layers or (0, self.layout.num_layers)
        lay, remote = self._layer_views(t, lo, hi)
        # receiver staging is an option only while this chunk's payload still fits in it
        payload = lay.num_layers * lay.kv_factor * (stop - start) * HeadMap.between(lay, remote).count * lay.head_bytes
        fits = payload <= req.staging_bytes - t.staged_bytes
        kinds = tuple(k for k in cfg.kinds if not k.scatters or fits)
        if PlanKind.STAGED_SEND in kinds and _shape_of_prestage(r.prestaged, t, c):
            # the prestage planned this request's shape for this layout: a staged send, which
            # costs no estimate of the other kinds (a third of planning a 128-token request)
            kinds = (PlanKind.STAGED_SEND,)
        t_plan = time.perf_counter()
        plan = plan_transfer(lay, c.blocks, remote, t.blocks, (start, stop),
                             src_first_token=c.first_token, dst_first_token=req.first_token,
                             kinds=kinds, costs=cfg.costs)
        rec = r.record
        rec.plan_s += time.perf_counter() - t_plan
        rec.plan, rec.plan_reason, r.plan = plan.kind.value, "", plan
        # what the next room may be prestaged for: this layout, if this request had the usual shape
        self._last_pull = (t.remote, plan.kind is PlanKind.STAGED_SEND and req.token_start == 0 and req.first_token == 0)
        deadline = min(r.deadline - time.monotonic(), cfg.write_timeout_s)
        base = req.staging_addr + t.staged_bytes  # scattering kinds: into the staging this receiver set aside
        if plan.kind.scatters:  # for this sender, after what is there
            wire = plan.wire.shifted(dst_by=base)
            allowed = np.array([[req.staging_addr, req.staging_addr + req.staging_bytes]], dtype=np.int64)
        else:
            wire, allowed = plan.wire, t.allowed
        # the guard: not one byte outside what this receiver set aside for this room
        check_segments_inside(wire.dst, wire.length, allowed, f"room {r.room}")
        # what is moved, for the receiver to compare with what lands: taken from the pool
        # (which nothing writes while the room holds its blocks) beside the writes
        digest = None
        if req.digest:
            digest = self._digester.submit(self._digest, lay, remote, c, start, stop, rec, t.digest_algorithm)
        try:
            if plan.kind is PlanKind.STAGED_SEND:
                pre = self._usable_prestage(r, t, c, plan)
                try:
                    self._pipeline(r, t.peer, req.session, plan.chunks(cfg.chunk_bytes), ring, deadline, pre)
                finally:
                    if pre is not None:  # every write that read it has settled
                        self.drop_prestage(r, used=True)
            elif plan.kind is PlanKind.STAGED_BOTH:
                self.drop_prestage(r, used=False)
                chunks = plan.chunks(cfg.chunk_bytes)
                self._pipeline(r, t.peer, req.session, chunks, ring, deadline, dst_base=base)
            else:
                self.drop_prestage(r, used=False)
                t0 = time.perf_counter()
                rec.wrote_at = rec.wrote_at or time.monotonic()
                h = self._write(req.session, wire, deadline, functools.partial(self.stop_reason, r, t.peer))
                try:
                    self._await(r, h, peer=t.peer, last=True)
                finally:
                    self._settle_write(h)
                rec.transfer_s += time.perf_counter() - t0
                rec.chunks += 1
        except BaseException:
            if digest is not None:
                digest.cancel()  # the room fails: a digest under way only reads the pool
            raise
        if digest is not None:
            t.digest.append(digest.result())  # one that raised fails the room, as a failed write does
        if plan.kind.scatters:  # what the receiver scatters: each chunk in its own staging order
            parts = chunks if plan.kind is PlanKind.STAGED_BOTH else [plan]
            for part in parts:
                t.staged.append(P.StagedChunk(first_token=c.first_token, start=part.spec.start, stop=part.spec.stop,
                                              offset=t.staged_bytes, blocks=c.blocks.tolist(),
                                              layer_start=lo if c.layers else 0, layer_stop=hi if c.layers else 0))
                t.staged_bytes += part.nbytes
        t.layer_bytes[lo:hi] += plan.nbytes // (hi - lo)  # every layer of a range moves the same bytes
        rec.bytes += plan.nbytes
        rec.segments += plan.num_segments
        t.bytes += plan.nbytes
        t.segments += plan.num_segments

    def _digest(self, lay: KVLayout, remote: KVLayout, c: "SendChunk", start: int, stop: int, rec,
                algorithm: str) -> P.DigestPart:
        """The content digest of tokens ``[start, stop)`` of chunk ``c`` in ``lay``'s layers,
        the heads ``remote`` holds (``kvbridge.layout.digest``); a layer range's part gets its
        share of ``MAX_UNITS``, so a layer-wise room's Done stays as small as a whole one's."""
        t0 = time.perf_counter()
        hm = HeadMap.between(lay, remote)
        share = max(1, MAX_UNITS * lay.num_layers // self.layout.num_layers)
        grid = grid_for(lay, heads=(hm.global_start, hm.count), tokens=(start, stop), max_units=share)
        rec.digest_algorithm = algorithm
        values = kv_digest(lay, c.blocks, c.first_token, grid, split=self._split,  # the gather's threads
                           algorithm=algorithm)
        rec.digest_s += time.perf_counter() - t0
        return P.DigestPart(layers=list(grid.layers), heads=list(grid.heads), tokens=[start, stop],
                            unit_tokens=grid.unit_tokens, values=values.view(np.int64).tolist())

    def _layer_views(self, t: "SendTarget", lo: int, hi: int) -> tuple[KVLayout, KVLayout]:
        """This rank's and target ``t``'s layouts seen as layers ``[lo, hi)`` only, built once
        per sender (ours) and per target (its) and reused for every piece of that range."""
        if (lo, hi) == (0, self.layout.num_layers):
            return self.layout, t.remote
        own = self._own_views.get((lo, hi))
        if own is None:
            own = self._own_views[(lo, hi)] = self.layout.layer_range(lo, hi)
        theirs = t.views.get((lo, hi))
        if theirs is None:
            theirs = t.views[(lo, hi)] = t.remote.layer_range(lo, hi)
        return own, theirs

    def _pipeline(self, r: "SendRoom", peer: str, session: str, chunks: list, ring: torch.Tensor, deadline_s: float,
                  pre: Prestaged | None = None, dst_base: int | None = None) -> None:
        """Staged send: gather the plan into the staging ring part by part, each part written
        as soon as it is gathered. Parts start at ``first_part_bytes`` and double up to
        ``part_bytes`` or a quarter of the plan (bytes are on the wire after a tiny gather); a region of the ring is
        gathered into again only once the write that read it has completed, so up to
        ``ring_parts`` writes are in flight while the next part is gathered. No part is
        submitted once the decode peer has been silent for ``peer_timeout_s`` (it gives the
        room up then; e.g. this process was stopped and has just resumed). With ``pre``, the
        first part was gathered before the request came and goes out first. ``chunks``: the
        plan's (``plan.chunks``); with ``dst_base`` (``staged_both``) each chunk's wire lands
        in the receiver's staging from there, chunk after chunk."""
        cfg, rec = self.config, r.record
        regions = ring.numel() // cfg.part_bytes
        inflight: deque = deque()
        end = time.monotonic() + deadline_s
        want = cfg.first_part_bytes
        # no part over a quarter of the plan: the last part's gather then overlaps the wire of
        # the ones before it (a 16 MiB request as parts up to 16 MiB: 1, 2, 4, 8 MiB, and the
        # last 8 MiB gathered after the wire ran dry: 0.5-0.9 ms more than parts up to 4 MiB)
        cap = min(cfg.part_bytes, max(cfg.first_part_bytes, sum(ch.nbytes for ch in chunks) // 4))
        k = 0
        guard = functools.partial(self.stop_reason, r, peer)
        try:
            landed = 0  # staged_both: where this chunk starts in the receiver's staging
            for i, chunk in enumerate(chunks):
                a = 0
                wire = chunk.wire if dst_base is None else chunk.wire.shifted(dst_by=dst_base + landed)
                landed += chunk.nbytes
                if i == 0 and pre is not None and pre.gather.nbytes != chunk.nbytes:
                    log.error("sender: room %s: prestaged part does not fit its first chunk; not used", r.room)
                    pre = None
                if i == 0 and pre is not None:
                    t0 = time.perf_counter()
                    rec.wrote_at = rec.wrote_at or time.monotonic()
                    pre_bytes = pre.rows * pre.gather.row_bytes
                    w = wire.window(0, pre_bytes).shifted(src_by=pre.addr)
                    inflight.append(self._write(session, w, end - time.monotonic(), guard))
                    rec.transfer_s += time.perf_counter() - t0
                    rec.chunks += 1
                    k, a, want = k + 1, pre.rows, max(want, pre_bytes)
                t0 = time.perf_counter()
                # builds each part's row index as that part is gathered
                gather = pre.gather if i == 0 and pre is not None else chunk.gather()
                rec.repack_s += time.perf_counter() - t0
                rb = gather.row_bytes
                while a < gather.rows:
                    why = self.stop_reason(r, peer)
                    if why:
                        raise HandoffFailed(why)
                    b = min(gather.rows, a + max(1, min(want, cap) // rb))
                    want *= 2
                    if len(inflight) == regions:  # the region we are about to reuse must be sent
                        t0 = time.perf_counter()
                        self._await(r, inflight[0], end - time.monotonic(), peer)
                        inflight.popleft()
                        rec.transfer_s += time.perf_counter() - t0
                    region = ring[(k % regions) * cfg.part_bytes:]
                    t0 = time.perf_counter()
                    gather.run(region, rows=(a, b), split=self._split)
                    rec.repack_s += time.perf_counter() - t0
                    rec.copy_threads = max(rec.copy_threads, threads_taken(self._split))
                    t0 = time.perf_counter()  # submitting the part's write counts as transfer time
                    rec.wrote_at = rec.wrote_at or time.monotonic()
                    w = wire.window(a * rb, b * rb).shifted(src_by=region.data_ptr())
                    inflight.append(self._write(session, w, end - time.monotonic(), guard))
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

    def _await(self, r: "SendRoom", h, timeout_s: float | None = None, peer: str | None = None,
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
            why = self.stop_reason(r, peer)
            if why:
                raise HandoffFailed(why)
            if h.poll():
                return
            if end is not None and time.monotonic() > end:
                h.wait(1e-6)  # raises TransportTimeout unless it just completed
                return
            time.sleep(sleep)
            sleep = min(2 * sleep, h.sleep_cap() if last else 1e-3)

    def stop_reason(self, r: "SendRoom", peer: str | None) -> str | None:
        """Why no further piece of room ``r`` may go to ``peer`` (None: it may): the room
        ended, or the peer has been silent longer than ``peer_timeout_s``, so it has given
        the room up and may reuse its blocks (e.g. this process was stopped and has just
        resumed). Asked before each gather and, as the transport's write guard, right
        before each piece is handed to the engine."""
        if r.state in TERMINAL:
            return f"room {r.room} ended during the transfer: {r.reason}"
        if peer is not None:
            heard = self.side.last_heard(peer)
            silent = 0.0 if heard is None else time.monotonic() - heard
            if silent > self.config.peer_timeout_s:
                return (f"decode peer silent for {silent:.1f} s (> {self.config.peer_timeout_s:.1f} s): "
                        "it has given the room up; no more writes into its blocks")
        return None

    def _write(self, session: str, w, deadline_s: float, guard) -> "WriteHandle":
        """Start writing wire segments ``w`` to ``session``. A write that fails as it starts
        (its guard stopped it, a submit failed) is settled before the error goes on: pieces
        it handed the engine first may still land."""
        try:
            return self.transport.write_async(session, w.src, w.dst, w.length, deadline_s, guard=guard)
        except TransportError as e:
            h = getattr(e, "handle", None)
            if h is not None:
                self._settle_write(h)
            raise

    def _settle_write(self, h) -> None:
        """After a write ended (or to end it): wait until the engine holds none of its
        pieces, so our staging slot and the peer's blocks may be reused. No timeout: until
        then a piece may still land (the transfer engine ends each piece itself, at its own
        transfer timeout); logged every ``write_timeout_s``."""
        if not h.done:
            h.abort("room failed")
        waited = 0.0
        while not h.settle(self.config.write_timeout_s):
            waited += self.config.write_timeout_s
            log.error("sender: pieces of a failed write to %s are still in the transfer engine after %.0f s; the room "
                      "stays unsettled (its decode blocks quarantined) until they are out", h.peer, waited)
