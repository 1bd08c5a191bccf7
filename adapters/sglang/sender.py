"""The per-request sender of the kvbridge SGLang backend (prefill side)."""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender

from kvbridge.common.handoff import RoomState

from .failures import fails_the_request as _fails_the_request
from .failures import recorded_failure as _recorded_failure
from .manager import KVBridgeKVManager

__all__ = ["KVBridgeKVSender"]

log = logging.getLogger(__name__)

_STATE = {
    RoomState.FAILED: KVPoll.Failed,
    RoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RoomState.WAITING: KVPoll.WaitingForInput,
    RoomState.TRANSFERRING: KVPoll.Transferring,
    RoomState.SUCCESS: KVPoll.Success,
}


def _guarded(mgr: KVBridgeKVManager, room: int, fn) -> None:
    """``fn`` (a sender call); a refusal fails the room instead of raising."""
    try:
        fn()
    except (KeyError, ValueError) as e:
        log.error("kvbridge: room %s: %s", room, e)
        mgr.kv_sender.abort(room, f"kvbridge: {e}")


class KVBridgeKVSender(CommonKVSender):
    """One per request on each prefill rank, made by ``create_sender`` (prefill.py)
    when the request enters the bootstrap queue.

    SGLang then polls it until WaitingForInput (a decode rank asked for the room),
    reads ``pop_decode_prefix_len``, calls ``init(num_pages, aux_index)`` and, after
    each prefill chunk (and for a prefix cached on this prefill, before it:
    ``maybe_send_cached_prefix_chunk``), ``send(page_ids, num_kv_tokens=n)`` with the
    next consecutive slice of its page list, from the returned prefix on; it polls the
    inflight queue until Success or Failed. Every one of these runs on the prefill
    scheduler's event loop and never raises (``_fails_the_request``).
    """

    supports_host_tensor_indices = False  # page ids arrive as numpy; no pinned D2H path

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self._prefix = 0  # first token this sender sends: the decode's prefix, on a page boundary of ours
        self._pages_sent = 0
        self._tokens_sent = 0
        self._added = False
        self._kvb_inited = False  # init() came: the decode asked and the prefix is known
        self._kvb_covered: int | None = None  # layer-wise: tokens before this went in every layer
        self._kvb_ended = ""  # layer-wise: how the room's last chunk went ("finish" or "send")
        self._kvb_whole_tokens = 0  # layer-wise: tokens sent whole (not streamed by a forward)
        self.kvb_layer_pieces = 0  # layer-wise pieces handed to the sender
        # the room's timeline (time.monotonic()): the decode asked (init), the last chunk was
        # handed over (the forward that computed it is done), the room succeeded; logged once
        self._kvb_t: dict[str, float] = {}
        if self.conclude_state is None and not mgr.is_dummy_cp_rank:
            kvs = mgr.kv_sender
            kvs.forget(bootstrap_room)  # a finished room of the same id from an earlier request
            try:
                kvs.add_room(bootstrap_room)
                self._added = True
            except Exception as e:  # e.g. the room is still open here: this request fails, not the scheduler
                mgr.record_failure(bootstrap_room, f"kvbridge: {e}")
                mgr.update_status(bootstrap_room, KVPoll.Failed)

    def _kvb_fail(self, reason: str) -> None:
        """End the request as Failed with ``reason``; the decode side is told."""
        mgr = self.kv_mgr
        mgr.record_failure(self.bootstrap_room, reason)
        mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        if self._added:
            mgr.kv_sender.abort(self.bootstrap_room, reason)

    def _requests(self) -> list:
        return self.kv_mgr.kv_sender.requests(self.bootstrap_room)

    @_fails_the_request(result=0)
    def pop_decode_prefix_len(self) -> int:
        """The tokens to skip: what the decode side already holds (its TransferRequest's
        token_start), rounded down to this server's page, since SGLang slices this
        request's pages from there (kvbridge writes only past the decode's own prefix,
        so the decode's page size may be any)."""
        reqs = self._requests()
        held = min((r.token_start for r in reqs), default=0)
        ps = int(self.kv_mgr.kv_args.page_size)
        self._prefix = held - held % ps
        return self._prefix

    @_fails_the_request()
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        """Prefill scheduler, once the decode has asked (finalize_bootstrap): the request's
        page count past the prefix ``pop_decode_prefix_len`` returned, and its metadata row."""
        super().init(num_kv_indices, aux_index)
        self._kvb_inited = True
        self._kvb_t["asked"] = time.monotonic()

    # -- layer-wise (kvbridge.adapters.sglang.layerwise, on the scheduler's thread) ---------
    def kvb_streamable(self) -> bool:
        """Whether a forward may stream this room's layers now: it is open with kvbridge, its
        decode asked (``init`` came), and its last chunk has not been given."""
        if not (self._added and self._kvb_inited) or self.conclude_state is not None or self._kvb_ended:
            return False
        return self.kv_mgr.kv_sender.poll(self.bootstrap_room) not in (RoomState.SUCCESS, RoomState.FAILED)

    def kvb_covered(self) -> int:
        """The first token not yet handed to kvbridge's sender in every layer."""
        sent = self._prefix + self._tokens_sent
        return sent if self._kvb_covered is None else max(self._kvb_covered, sent)

    def kvb_note_streamed(self, stop: int) -> None:
        """Tokens before ``stop`` went layer by layer (every layer handed over)."""
        self._kvb_covered = max(self.kvb_covered(), int(stop))

    def kvb_note_whole(self, stop: int) -> None:
        """Tokens up to ``stop`` (a prefix cached here) went whole before a streamed forward."""
        self._kvb_whole_tokens += max(0, int(stop) - self.kvb_covered())
        self._kvb_covered = max(self.kvb_covered(), int(stop))

    @_fails_the_request()
    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
        """One prefill chunk: the next ``len(kv_indices)`` pages of the request, holding
        its next ``num_kv_tokens`` tokens (whole pages when SGLang does not say: a chunk
        that is not the last one always ends on a page boundary)."""
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed):
            return
        mgr = self.kv_mgr
        if state_indices is not None and any(s is not None for s in state_indices):
            return self._kvb_fail("kvbridge does not move SGLang state pools (mamba/SWA/DSA)")
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        ps = int(mgr.kv_args.page_size)
        ntok = int(num_kv_tokens) if num_kv_tokens is not None else pages.size * ps
        start = self._prefix + self._tokens_sent
        if start % ps or -(-ntok // ps) != pages.size:
            return self._kvb_fail(f"kvbridge: a chunk of {pages.size} pages of {ps} tokens cannot hold tokens "
                                  f"[{start}, {start + ntok}) (chunks must start on a page boundary)")
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        self._pages_sent += pages.size
        self._tokens_sent += ntok
        self.curr_idx = self._pages_sent
        last = self._pages_sent >= self.num_kv_indices
        if last:
            self._kvb_t.setdefault("last_chunk", time.monotonic())
        if not self._added:
            if last and mgr.is_dummy_cp_rank:  # as CommonKVSender: a dummy CP rank sends nothing
                mgr.update_status(self.bootstrap_room, KVPoll.Success)
            return
        # An early send of a prefix cached here comes before this step's forward is queued;
        # under the overlap scheduler the previous forward may still write those pages
        # (prefill.py maybe_send_cached_prefix_chunk records an event for that).
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        if wait_event is not None:
            wait_event.synchronize()
        aux = mgr.read_aux_row(self.aux_index) if last and self.aux_index is not None else None
        if self._kvb_covered is not None:
            self._send_rest(pages, start, start + ntok, last, aux)
        else:
            mgr.kv_sender.send_chunk(self.bootstrap_room, pages, start, start + ntok, last=last, first_token=start,
                                     aux=aux)
        self._record_transfer_indices(pages, None)

    def _send_rest(self, pages: np.ndarray, start: int, stop: int, last: bool, aux) -> None:
        """A chunk of a room that forwards streamed: only its tokens no forward handed over
        go (whole); the last chunk ends the room, with ``finish`` when nothing is left."""
        mgr = self.kv_mgr
        ps = int(mgr.kv_args.page_size)
        room = self.bootstrap_room
        rest = max(start, self._kvb_covered)
        if last:
            self._kvb_ended = "send" if rest < stop else "finish"
        if rest < stop:
            skip = (rest - start) // ps
            first = start + skip * ps
            blocks = pages[skip:]
            self._kvb_whole_tokens += stop - rest
            self._kvb_covered = stop
            fn = lambda: mgr.kv_sender.send_chunk(room, blocks, rest, stop, last=last, first_token=first, aux=aux)
        elif last:
            fn = lambda: mgr.kv_sender.finish(room, aux)
        else:
            return
        st = mgr.kvb_streamer
        if st is not None:
            st.call(lambda: _guarded(mgr, room, fn), on_cuda=str(getattr(mgr.layout, "device", "")).startswith("cuda"))
        else:
            fn()
        if last:
            log.info("kvbridge: room %s went layer by layer: %d layer piece(s), %d token(s) sent whole; ended by %s",
                     room, self.kvb_layer_pieces, self._kvb_whole_tokens, self._kvb_ended)

    @_fails_the_request(result=KVPoll.Failed)
    def poll(self) -> KVPoll:
        """Prefill scheduler, every pass of its bootstrap and inflight queues: the room's
        state (kvbridge's, mapped to KVPoll)."""
        mgr = self.kv_mgr
        if self.conclude_state is not None:
            # aborted here (CommonKVSender.abort concludes Failed at once): SGLang frees the
            # source pages once it polls Failed, so that waits until no piece still reads them
            if (self.conclude_state == KVPoll.Failed and self._added
                    and mgr.kv_sender.poll(self.bootstrap_room) not in (RoomState.SUCCESS, RoomState.FAILED)):
                return KVPoll.Transferring
            return self.conclude_state
        if self._added:
            st = mgr.kv_sender.poll(self.bootstrap_room)
            if st is RoomState.SUCCESS and "done" not in self._kvb_t:
                self._log_timeline()
            if st is RoomState.FAILED:
                mgr.record_failure(self.bootstrap_room, mgr.kv_sender.failure_reason(self.bootstrap_room))
            if self.bootstrap_room in mgr.request_status:
                mgr.update_status(self.bootstrap_room, _STATE[st])
        out = super().poll()
        if out == KVPoll.Failed and self._added and mgr.kv_sender.poll(self.bootstrap_room) not in (RoomState.SUCCESS,
                                                                                                      RoomState.FAILED):
            # SGLang failed the request itself (e.g. its bootstrap timeout): end the room now,
            # telling any decode rank, rather than holding it open to its deadline; SGLang
            # frees the pages once it polls Failed, so that waits until no piece reads them
            mgr.kv_sender.abort(self.bootstrap_room, f"the prefill engine failed the request: {_recorded_failure(self)}")
            if mgr.kv_sender.poll(self.bootstrap_room) not in (RoomState.SUCCESS, RoomState.FAILED):
                return KVPoll.Transferring
        return out

    def _log_timeline(self) -> None:
        """One line per room that succeeded: from the decode's request to the last chunk
        handed over (the prefill's queue and forward), and from there to the room's
        success (the send after the forward: ~0 when every layer streamed during it)."""
        t = self._kvb_t
        t["done"] = time.monotonic()
        if "asked" in t and "last_chunk" in t:
            log.info("kvbridge: room %s timeline: last chunk %.1f ms after the decode asked, done %.1f ms after it "
                     "(monotonic %.6f %.6f %.6f)", self.bootstrap_room, (t["last_chunk"] - t["asked"]) * 1e3,
                     (t["done"] - t["last_chunk"]) * 1e3, t["asked"], t["last_chunk"], t["done"])

    def get_transfer_metric(self):
        m = super().get_transfer_metric()
        try:
            rec = self.kv_mgr.kv_sender.record(self.bootstrap_room) if self._added else None
        except Exception:  # figures only: never worth failing a request for
            log.exception("kvbridge: room %s: no transfer record", self.bootstrap_room)
            rec = None
        if rec is not None:
            m.transfer_total_bytes = int(rec.bytes)
            if rec.transfer_s:
                m.transfer_latency_s = float(rec.transfer_s + rec.repack_s)
        return m

    @_fails_the_request()
    def abort(self):
        """Prefill scheduler, on an AbortReq: the room ends and the decode side is told."""
        super().abort()
        if self._added:
            self.kv_mgr.kv_sender.abort(self.bootstrap_room, "aborted by prefill (AbortReq)")

    @_fails_the_request()
    def clear(self) -> None:
        """Prefill scheduler, when the request leaves its queues: drop the room's bookkeeping."""
        super().clear()
        if self._added:
            self.kv_mgr.kv_sender.forget(self.bootstrap_room)
