"""The Mooncake transfer engine behind one small, robust interface.

``MooncakeTransport`` registers memory once, writes byte segments to a peer in
bounded, non-blocking pieces and waits for them with a deadline, sleeping between
polls instead of spinning. It speaks TCP on 127.0.0.1 in tests and RDMA/NVLink on
GPU hosts with the same code.

How completion is polled, and why (checked against kvcache-ai/Mooncake at 3b5a594,
mooncake-integration/transfer_engine/transfer_engine_py.cpp unless named, and
against the installed 0.3.13.post1 wheel, which behaves the same):

* ``get_batch_transfer_status([ids])`` (``getBatchTransferStatus``, l. 715-770)
  releases the GIL and loops ``while (!timeout_table.empty() && !failed_or_timeout)``
  (l. 737) over ``engine_->getBatchTransferStatus`` with no sleep until every batch
  is final: it blocks and burns a core for the whole transfer. Not used.
* ``transfer_check_status(id)`` (``transferCheckStatus``, l. 813-829) is
  non-blocking but reads ONE task::

      Status s = engine_->getTransferStatus(batch_id, 0, status);
      if (status.s == TransferStatusEnum::COMPLETED) { engine_->freeBatchID(batch_id); return 1; }
      else if (status.s == TransferStatusEnum::FAILED) { engine_->freeBatchID(batch_id); return -1; }
      else if (status.s == TransferStatusEnum::TIMEOUT) { return -2; } else { return 0; }

  On a batch of several pieces it returns 1 as soon as piece 0 is done (measured
  here: at 6 ms of a 250 ms two-piece batch), and its ``freeBatchID`` then fails
  with BatchBusy (mooncake-transfer-engine/src/multi_transport.cpp l. 104-110
  refuses while any task is not ``is_finished``), leaking the batch. On a
  ONE-piece batch it is exact, and the id is freed exactly when it reports a final
  1 / -1 (it must never be polled again after that; -2 is neither final nor freed).
* ``batch_transfer_async_write`` returns 0 when the peer's segment cannot be opened
  or the submit fails (l. 664, 673, 706; older builds returned -1 = ``2**64 - 1``).
* The TCP transport queues one work item per piece per peer:
  ``kDefaultQueuedTransfersPerPeer = 1024`` plus ``kDefaultPendingAdmissionsPerPeer
  = 1024`` that wait at most ``kDefaultAdmissionTimeoutMs = 1000``
  (src/transport/tcp_transport/tcp_transport.cpp l. 254-259); beyond that pieces
  fail with "TCP lane queue-full" (one 3000-piece call fails here).

* A TCP write piece is COMPLETED only once the peer has copied it into its memory
  and said so (Mooncake's TCP protocol v2, ``tcp_transport_session_impl.h``: the server
  sends a status frame after the last chunk is applied). A sender's TransferDone rests on
  this. ``MC_TCP_PROTO=1`` selects the v1 framing, whose writes complete once in the
  local socket (33 KiB to a SIGSTOPped peer: 2.5 ms); never set it
  (``tests/test_transport.py::test_a_completed_write_is_in_the_peers_memory``).

So every piece is its own one-piece batch, submitted through
``batch_transfer_async_write`` a chunk at a time (about 3 us per piece measured,
against 1-2 us per piece inside one large batch), with at most
``max_inflight_per_peer`` pieces in flight per peer across all writes of this
transport, and completion is read with ``transfer_check_status`` oldest first,
sleeping 50 us and backing off to 1 ms while nothing completes (to 100 us once only the
last piece is in flight: the caller waits on its completion, and 1 ms would be added
latency).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from .writes import (
    DEFAULT_MAX_PIECE_BYTES,
    MC_DONE,
    MC_FAILED,
    SLEEP_MAX_S,
    BatchResult,
    TransportError,
    TransportTimeout,
    WriteHandle,
    WritePorts,
    as_i64,
    split_pieces,
)

__all__ = [
    "BatchResult",
    "MooncakeTransport",
    "P2PHANDSHAKE",
    "TransportError",
    "TransportTimeout",
    "WriteHandle",
    "split_pieces",
]

log = logging.getLogger(__name__)

P2PHANDSHAKE = "P2PHANDSHAKE"


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (for the engine's RPC listener)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeTransport:
    """One Mooncake transfer engine: memory registration, bounded async writes to
    peers, completion by sleeping polls with deadlines.

    ``protocol="tcp"`` forces the TCP transport (``MC_FORCE_TCP=1``); otherwise the
    engine picks RDMA/NVLink when it finds a device. With ``P2PHANDSHAKE`` no
    metadata server is needed and ``session_id`` is ``host:rpc_port``.
    With a metadata server (etcd ``host:port``, ``http://...``) the session id is
    ``hostname:port`` with a free port added when ``hostname`` has none, one segment per
    engine. ``max_inflight_per_peer`` bounds the pieces in flight to one peer over all
    writes (Mooncake's TCP queue holds 1024 per peer); segments longer than
    ``max_piece_bytes`` are split; a poll submits at most ``submit_chunk`` pieces;
    ``check_local`` refuses source segments outside registered memory.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        metadata_server: str = P2PHANDSHAKE,
        protocol: str = "tcp",
        device_name: str = "",
        max_inflight_per_peer: int = 1024,
        *,
        max_piece_bytes: int = DEFAULT_MAX_PIECE_BYTES,
        submit_chunk: int = 256,
        check_local: bool = True,
    ):
        if max_inflight_per_peer < 1:
            raise ValueError(f"max_inflight_per_peer must be >= 1, got {max_inflight_per_peer}")
        if max_piece_bytes < 1 or submit_chunk < 1:
            raise ValueError("max_piece_bytes and submit_chunk must be >= 1")
        self.hostname = hostname
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.max_inflight_per_peer = int(max_inflight_per_peer)
        self.max_piece_bytes = int(max_piece_bytes)
        self.submit_chunk = int(submit_chunk)
        self.check_local = check_local
        self._lock = threading.Lock()
        self._registry: dict[int, int] = {}
        self._ranges: tuple[np.ndarray, np.ndarray] | None = None  # sorted (starts, ends), rebuilt on change
        self._inflight: dict[str, int] = {}
        self._zombies: deque[tuple[str, int, WriteHandle]] = deque()
        self._handles: weakref.WeakSet[WriteHandle] = weakref.WeakSet()
        self._engine: Any = None

        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - depends on the install
            raise TransportError(f"the Mooncake transfer engine is not importable: {e}") from e
        engine = TransferEngine()
        if metadata_server != P2PHANDSHAKE and ":" not in hostname:
            # with a metadata server the segment name is the hostname itself (no port is added),
            # so two engines of one host (TP ranks) would overwrite each other's segment there
            hostname = f"{hostname}:{_free_port(hostname)}"
        # Positional only; nothing else may be called on the engine before this succeeds.
        ret = engine.initialize(hostname, metadata_server, protocol, device_name)
        if ret != 0:
            raise TransportError(
                f"Mooncake initialize(hostname={hostname!r}, metadata_server={metadata_server!r}, "
                f"protocol={protocol!r}, device_name={device_name!r}) returned {ret}"
            )
        self._engine = engine
        if metadata_server == P2PHANDSHAKE:
            self._session_id = f"{hostname}:{engine.get_rpc_port()}"
        else:
            self._session_id = hostname
        log.info("Mooncake transport up: session %s, protocol %s", self._session_id, protocol)

    # -- identity ----------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """This engine's session id, the name peers write to."""
        return self._session_id

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._engine is None

    # -- registration ------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr + nbytes)`` with the engine; a repeat of the same
        range is a no-op, an overlapping different one a TransportError."""
        addr, nbytes = int(addr), int(nbytes)
        if addr <= 0 or nbytes <= 0:
            raise TransportError(f"cannot register 0x{addr:x} (+{nbytes} B): address and size must be positive")
        with self._lock:
            self._check_open()
            old = self._registry.get(addr)
            if old == nbytes:
                return
            if old is not None:
                raise TransportError(f"0x{addr:x} is registered with {old} B; unregister it before registering {nbytes} B")
            for a, n in self._registry.items():
                if a < addr + nbytes and addr < a + n:
                    raise TransportError(f"0x{addr:x} (+{nbytes} B) overlaps registered 0x{a:x} (+{n} B)")
            ret = self._engine.register_memory(addr, nbytes)
            if ret != 0:
                raise TransportError(f"Mooncake register_memory(0x{addr:x}, {nbytes}) returned {ret}")
            self._registry[addr] = nbytes
            self._ranges = None
        log.debug("registered 0x%x (+%d B)", addr, nbytes)

    def register_tensor(self, t: Any) -> tuple[int, int]:
        """Register a contiguous torch tensor's memory; returns (addr, nbytes)."""
        if not t.is_contiguous():
            raise TransportError(f"cannot register a non-contiguous tensor of shape {tuple(t.shape)}")
        addr, nbytes = int(t.data_ptr()), int(t.numel() * t.element_size())
        self.register(addr, nbytes)
        return addr, nbytes

    def unregister(self, addr: int) -> None:
        """Unregister memory registered at ``addr``; unknown addresses are ignored."""
        addr = int(addr)
        with self._lock:
            self._check_open()
            if addr not in self._registry:
                return
            ret = self._engine.unregister_memory(addr)
            del self._registry[addr]
            self._ranges = None
        if ret != 0:
            log.warning("Mooncake unregister_memory(0x%x) returned %d", addr, ret)

    # -- writes ------------------------------------------------------------------------

    def write_async(self, session: str, src_addrs, dst_addrs, lengths, deadline_s: float = 30.0,
                    guard: Callable[[], str | None] | None = None) -> WriteHandle:
        """Start writing ``lengths[i]`` bytes from local ``src_addrs[i]`` to the peer's
        ``dst_addrs[i]``; returns a handle to poll or wait on. Pieces are submitted
        at once up to the in-flight bound; a submit failure raises here. ``guard``, when
        given, is asked right before each piece is handed to the engine; a non-empty
        answer (why not) fails the write there, with no further piece submitted. A
        TransportError raised here carries the failed write as ``handle`` when pieces of it
        may already be in the engine (settle it before reusing its memory)."""
        self._check_open()
        src = as_i64("src_addrs", src_addrs)
        dst = as_i64("dst_addrs", dst_addrs)
        lens = as_i64("lengths", lengths)
        if not (src.shape == dst.shape == lens.shape):
            raise TransportError(f"src_addrs, dst_addrs and lengths differ in length: {src.size}, {dst.size}, {lens.size}")
        shortest = int(lens.min()) if lens.size else 0
        if shortest < 0:
            raise TransportError(f"negative segment length {shortest}")
        if shortest > 0:  # the usual case: no empty segment to leave out
            ls, ld, ll = src, dst, lens
        else:
            live = lens > 0
            ls, ld, ll = src[live], dst[live], lens[live]
        if ls.size and (int(ls.min()) <= 0 or int(ld.min()) <= 0):
            raise TransportError("segment addresses must be positive")
        if not deadline_s > 0:
            raise TransportError(f"deadline_s must be positive, got {deadline_s}")
        segments = int(ll.size)
        if self.check_local:
            self._check_local(ls, ll)
        ps, pd, pl = split_pieces(ls, ld, ll, self.max_piece_bytes)
        ports = WritePorts(lambda: self._engine, self._check_open, self._reap_zombies, self._acquire, self._release,
                           self._abandon, self.submit_chunk)
        handle = WriteHandle(ports, str(session), ps, pd, pl, segments, deadline_s, guard)
        self._handles.add(handle)
        try:
            handle.poll()
        except TransportError as e:  # pieces submitted before the failure may still be in the engine
            e.handle = handle
            raise
        return handle

    def write(self, session: str, src_addrs, dst_addrs, lengths, deadline_s: float = 30.0) -> BatchResult:
        """Write segments to the peer and wait for all of them (see ``write_async``)."""
        return self.write_async(session, src_addrs, dst_addrs, lengths, deadline_s).wait()

    def probe(self, session: str) -> bool:
        """True when the peer answers a handshake probe."""
        self._check_open()
        return self._engine.send_probe(str(session)) == 0

    # -- lifecycle ---------------------------------------------------------------------

    def close(self, drain_s: float = 1.0) -> None:
        """Abort unfinished writes, wait up to ``drain_s`` for pieces still in the
        engine, unregister memory and release the engine. Idempotent."""
        if self._engine is None:
            return
        for h in list(self._handles):
            h.abort("aborted: the transport is closing")
        end = time.monotonic() + drain_s
        while self._zombies and time.monotonic() < end:
            self._reap_zombies(limit=len(self._zombies))
            if self._zombies:
                time.sleep(SLEEP_MAX_S)
        if self._zombies:
            log.warning("closing with %d abandoned piece(s) still in the engine", len(self._zombies))
        with self._lock:
            engine, self._engine = self._engine, None
            for addr in list(self._registry):
                if engine.unregister_memory(addr) != 0:
                    log.warning("Mooncake unregister_memory(0x%x) failed during close", addr)
            self._registry.clear()
            self._zombies.clear()
            self._inflight.clear()
        del engine
        log.info("Mooncake transport %s closed", self._session_id)

    def __enter__(self) -> "MooncakeTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._registry)} regions"
        return f"MooncakeTransport({self._session_id}, {self.protocol}, {state})"

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._engine is None:
            raise TransportError("the transport is closed")

    def _check_local(self, src: np.ndarray, lens: np.ndarray) -> None:
        """Every source segment must lie inside one registered range."""
        if src.size == 0:
            return
        with self._lock:
            if self._ranges is None:
                items = sorted(self._registry.items())
                starts = np.array([a for a, _ in items], dtype=np.int64)
                self._ranges = starts, starts + np.array([n for _, n in items], dtype=np.int64)
            starts, ends = self._ranges
        if not starts.size:
            raise TransportError("no local memory is registered; register the source buffers first (or check_local=False)")
        idx = np.searchsorted(starts, src, side="right") - 1
        ok = (idx >= 0) & (src + lens <= ends[np.clip(idx, 0, None)])
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise TransportError(
                f"{int((~ok).sum())} source segment(s) outside registered local memory, first "
                f"0x{int(src[i]):x} (+{int(lens[i])} B)"
            )

    def _acquire(self, peer: str, want: int) -> int:
        """Reserve up to ``want`` in-flight slots for ``peer``; returns how many."""
        if want <= 0:
            return 0
        with self._lock:
            used = self._inflight.get(peer, 0)
            n = max(0, min(want, self.max_inflight_per_peer - used))
            self._inflight[peer] = used + n
            return n

    def _release(self, peer: str, n: int) -> None:
        if n:
            with self._lock:
                self._inflight[peer] = max(0, self._inflight.get(peer, 0) - n)

    def _abandon(self, peer: str, inflight: Sequence[tuple[int, int]], owner: WriteHandle) -> None:
        """Keep pieces a failed or timed-out write left in the engine, to reap later
        (they still hold their in-flight slots and their batch ids)."""
        with self._lock:
            self._zombies.extend((peer, bid, owner) for bid, _ in inflight)

    def _reap_zombies(self, limit: int = 64) -> None:
        if not self._zombies or self._engine is None:
            return
        for _ in range(min(limit, len(self._zombies))):
            with self._lock:
                engine = self._engine
                if not self._zombies or engine is None:
                    return
                item = self._zombies.popleft()
            st = engine.transfer_check_status(item[1])
            if st in (MC_DONE, MC_FAILED):
                self._release(item[0], 1)
                item[2].piece_settled()
            else:
                with self._lock:
                    self._zombies.append(item)
