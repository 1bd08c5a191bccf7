"""One write to a peer through the Mooncake transfer engine: its pieces, their
completion, and how a caller waits on it (``WriteHandle``); see ``kvbridge.common.transport``
for why each piece is its own one-piece batch, polled oldest first."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["BatchResult", "TransportError", "TransportTimeout", "WriteHandle", "WritePorts", "split_pieces", "as_i64",
           "DEFAULT_MAX_PIECE_BYTES", "MC_DONE", "MC_FAILED", "SLEEP_MAX_S"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PIECE_BYTES = 4 << 20  # pieces in flight spread over the TCP lanes; RDMA slices further itself
# Status codes of transfer_check_status.
MC_DONE, _PENDING, MC_FAILED, _MC_TIMEOUT = 1, 0, -1, -2
# Stop scanning in-flight pieces after this many pending ones in a row (they finish
# roughly in submission order; the rest are seen on later polls).
_SCAN_MISSES = 16
_SLEEP_MIN_S = 50e-6
SLEEP_MAX_S = 1e-3  # the longest sleep between polls of a write
_SLEEP_LAST_S = 100e-6  # the longest sleep while only the last piece is left: its completion is waited on


@dataclass(frozen=True)
class WritePorts:
    """What a ``WriteHandle`` uses of the transport that made it, handed over by it: the
    engine as it is now (None once closed; a test may wrap it meanwhile), the per-peer
    in-flight slots, and where pieces a failed write left in the engine are kept and reaped."""

    engine: Callable[[], Any]
    check_open: Callable[[], None]  # TransportError once the transport is closed
    reap_zombies: Callable[[int], None]  # poll up to that many abandoned pieces
    acquire: Callable[[str, int], int]  # reserve up to n in-flight slots for a peer: how many
    release: Callable[[str, int], None]
    abandon: Callable[[str, Sequence[tuple[int, int]], "WriteHandle"], None]
    submit_chunk: int  # pieces one poll submits at most


class TransportError(RuntimeError):
    """A transfer-engine operation that failed: init, registration, submit or a piece."""


class TransportTimeout(TransportError):
    """A write that did not complete before its deadline."""


@dataclass(frozen=True)
class BatchResult:
    """One completed write: ``bytes`` moved as ``segments`` segments (``pieces``
    engine pieces after splitting) in ``seconds``; ``gbps`` is GB/s (1e9 bytes/s)."""

    bytes: int
    segments: int
    seconds: float
    gbps: float
    pieces: int = 0


def as_i64(name: str, a: Any) -> np.ndarray:
    """``a`` as a 1-d int64 array (TransportError naming ``name`` when it is not one)."""
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1:  # what plans hand over: as is
        return a
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise TransportError(f"{name} must be a 1-d array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TransportError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def split_pieces(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, max_piece_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments cut into pieces of at most ``max_piece_bytes``, in order; zero-length
    segments are dropped. Returns int64 (src, dst, length) arrays."""
    if max_piece_bytes <= 0:
        raise ValueError(f"max_piece_bytes must be positive, got {max_piece_bytes}")
    if lengths.size and int(lengths.min()) > 0 and int(lengths.max()) <= max_piece_bytes:
        return src, dst, lengths  # the usual case: nothing to drop or cut (no copies made)
    keep = lengths > 0
    src, dst, lengths = src[keep], dst[keep], lengths[keep]
    counts = (lengths + (max_piece_bytes - 1)) // max_piece_bytes
    if counts.size == 0 or int(counts.max()) <= 1:
        return src, dst, lengths
    seg = np.repeat(np.arange(lengths.size), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    off = (np.arange(seg.size, dtype=np.int64) - first) * max_piece_bytes
    return src[seg] + off, dst[seg] + off, np.minimum(lengths[seg] - off, max_piece_bytes)


class WriteHandle:
    """A write in flight to one peer: ``poll()`` advances it without blocking,
    ``wait()`` blocks (sleeping) until it completes, fails or misses its deadline.
    Drive one handle from one thread at a time.

    After a TransportError, pieces already handed to the engine may still be read
    from local memory: keep the source buffers alive until the transport is closed.
    """

    def __init__(self, ports: "WritePorts", peer: str, src, dst, lengths, segments: int, deadline_s: float,
                 guard: Callable[[], str | None] | None = None):
        self._t = ports
        self._guard = guard
        self.peer = peer
        self.segments = segments
        self.pieces = int(lengths.size)
        self.nbytes = int(lengths.sum())
        self._src = src.tolist()
        self._dst = dst.tolist()
        self._len = lengths.tolist()
        self._start = time.monotonic()
        self._budget = float(deadline_s)
        self._deadline = self._start + self._budget
        self._next = 0  # next piece to submit
        self._inflight: deque[tuple[int, int]] = deque()  # (batch id, piece index), oldest first
        self._done_pieces = 0
        self._done_bytes = 0
        self._result: BatchResult | None = None
        self._error: TransportError | None = None
        self._leftover = 0  # pieces abandoned in the engine after a failure, not yet final

    @property
    def done(self) -> bool:
        """True once the write completed or failed."""
        return self._result is not None or self._error is not None

    @property
    def result(self) -> BatchResult | None:
        """The result once completed, else None."""
        return self._result

    def poll(self) -> bool:
        """Reap completed pieces and submit more; True when complete. Raises
        TransportError on a failed piece, TransportTimeout past the deadline."""
        if self._result is not None:
            return True
        if self._error is not None:
            raise self._error
        try:
            self._t.check_open()
            self._t.reap_zombies(64)
            self._reap()
            if self._next == self.pieces and not self._inflight:
                self._finish()
                return True
            if time.monotonic() > self._deadline:
                elapsed = time.monotonic() - self._start
                raise TransportTimeout(self._describe(f"timed out after {elapsed:.3f}s (deadline {self._budget:.3f}s)"))
            self._submit()
        except TransportError as e:
            if self._error is None:
                self._fail(e)
            raise self._error from None
        return False

    def wait(self, deadline_s: float | None = None) -> BatchResult:
        """Block until complete and return the result; ``deadline_s`` (seconds from
        now), when given, replaces the remaining deadline."""
        if deadline_s is not None:
            self._deadline = time.monotonic() + float(deadline_s)
            self._budget = self._deadline - self._start
        sleep = _SLEEP_MIN_S
        while True:
            before = self._done_pieces
            if self.poll():
                assert self._result is not None
                return self._result
            sleep = _SLEEP_MIN_S if self._done_pieces != before else min(sleep * 2, self.sleep_cap())
            time.sleep(max(0.0, min(sleep, self._deadline - time.monotonic())))

    def sleep_cap(self) -> float:
        """The longest a waiter should sleep between polls now: short once only the last
        piece is in flight (its completion is what the caller waits for), else 1 ms."""
        return _SLEEP_LAST_S if self._next == self.pieces and len(self._inflight) <= 1 else SLEEP_MAX_S

    def settle(self, timeout_s: float) -> bool:
        """After the write completed, failed or was aborted: wait up to ``timeout_s``
        until the engine holds none of its pieces, so its source memory (and the
        peer's destination) may be reused. True when none is left."""
        if not self.done:
            raise TransportError(self._describe("is still in progress; wait() or abort() it before settle()"))
        end = time.monotonic() + timeout_s
        while self._leftover and self._t.engine() is not None:
            self._t.reap_zombies(1 << 30)
            if not self._leftover or time.monotonic() >= end:
                break
            time.sleep(SLEEP_MAX_S)
        return self._leftover == 0 or self._t.engine() is None

    def abort(self, reason: str = "aborted") -> None:
        """Stop submitting; later polls raise TransportError. Pieces already in
        flight are left to the engine (and reaped by the transport)."""
        if not self.done:
            self._fail(TransportError(self._describe(reason)), level=logging.INFO)

    # -- internals -------------------------------------------------------------------

    def piece_settled(self) -> None:
        """One piece this write abandoned in the engine has reached a final status."""
        self._leftover -= 1

    def _describe(self, what: str) -> str:
        return (
            f"write to peer {self.peer} {what} [{self._done_pieces}/{self.pieces} pieces and "
            f"{self._done_bytes}/{self.nbytes} bytes done, {len(self._inflight)} pieces in flight, "
            f"{self.pieces - self._next} not submitted]"
        )

    def _reap(self) -> None:
        engine = self._t.engine()
        kept: list[tuple[int, int]] = []
        misses = 0
        freed = 0
        try:
            while self._inflight and misses < _SCAN_MISSES:
                bid, i = self._inflight.popleft()
                st = engine.transfer_check_status(bid)
                if st == _PENDING:
                    kept.append((bid, i))
                    misses += 1
                elif st == MC_DONE:
                    freed += 1
                    self._done_pieces += 1
                    self._done_bytes += self._len[i]
                else:
                    if st == MC_FAILED:
                        freed += 1  # freed by the engine
                    else:
                        kept.append((bid, i))  # -2 (or unknown): not freed, keep polling it as a zombie
                    where = f"piece {i} (0x{self._src[i]:x} -> 0x{self._dst[i]:x}, {self._len[i]} B)"
                    if st == _MC_TIMEOUT:
                        raise TransportTimeout(self._describe(f"timed out inside the transfer engine at {where}"))
                    raise TransportError(
                        self._describe(
                            f"failed at {where} with engine status {st} (the peer is gone, or the remote "
                            "range is outside its registered memory)"
                        )
                    )
        finally:
            self._inflight.extendleft(reversed(kept))
            self._t.release(self.peer, freed)

    def _submit(self) -> None:
        granted = self._t.acquire(self.peer, min(self.pieces - self._next, self._t.submit_chunk))
        if not granted:
            return
        engine, peer = self._t.engine(), self.peer
        used = 0
        try:
            for i in range(self._next, self._next + granted):
                why = self._guard() if self._guard is not None else None
                if why:  # checked right before each piece: the peer may have given the write up
                    raise TransportError(self._describe(f"stopped before piece {i}: {why}"))
                bid = engine.batch_transfer_async_write(peer, [self._src[i]], [self._dst[i]], [self._len[i]])
                if bid <= 0 or bid >= 2**64 - 1:
                    raise TransportError(
                        self._describe(
                            f"could not be submitted: the engine returned batch id {bid} for piece {i} (the "
                            "peer is unreachable, its session id is wrong, or the engine refused the piece)"
                        )
                    )
                self._inflight.append((bid, i))
                used += 1
        finally:
            self._next += used
            self._t.release(self.peer, granted - used)

    def _finish(self) -> None:
        seconds = max(time.monotonic() - self._start, 1e-9)
        self._result = BatchResult(self.nbytes, self.segments, seconds, self.nbytes / seconds / 1e9, self.pieces)
        log.debug("write to %s: %d B, %d segments, %d pieces in %.6fs (%.2f GB/s)", self.peer, self.nbytes, self.segments, self.pieces, seconds, self._result.gbps)

    def _fail(self, err: TransportError, level: int = logging.WARNING) -> None:
        self._error = err
        self._leftover += len(self._inflight)
        self._t.abandon(self.peer, self._inflight, self)
        self._inflight = deque()
        log.log(level, "%s", err)
