"""The per-request receiver of the kvbridge SGLang backend (decode side)."""

from __future__ import annotations

import logging
import time
from typing import List, Optional

import numpy as np

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import AbortNotification, CommonKVReceiver

from kvbridge.common import protocol as P
from kvbridge.common.auth import AuthError
from kvbridge.common.bootstrap import open_route_info, refused
from kvbridge.common.handoff import TERMINAL, RoomState
from kvbridge.layout import LayoutError

from .failures import fails_the_request as _fails_the_request
from .manager import ABORT_DOMAIN, KVBridgeKVManager, abort_seal_payload

__all__ = ["KVBridgeKVReceiver"]

log = logging.getLogger(__name__)


class KVBridgeKVReceiver(CommonKVReceiver):
    """One per request on each decode rank, made by ``_create_receiver_and_enqueue``
    (decode.py). SGLang calls ``init(prefill_dp_rank)`` once the prefill's parallel
    info is known (Common resolves the prefill ranks to pull from through the bootstrap
    server), ``send_metadata(page_ids, aux_index, state_indices, decode_prefix_len)``
    once pages are allocated (kvbridge's hook on ``_send_kv_metadata`` tells it first how
    many tokens those pages are for: ``note_transfer_tokens``), and polls until
    Success/Failed; Success is reported only after the metadata row (first output
    token...) is in row ``aux_index``. All of these run on the decode scheduler's event
    loop and never raise (``_fails_the_request``).
    """

    kvb_release_rule = True  # its failed request's pages go back on kvbridge's proof, not SGLang's timer

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._requested = False
        self._kvb_declined = False  # the cost gate declined the room: the prefill ranks were told by kvbridge
        self._aux_index: Optional[int] = None
        self._transfer_tokens: Optional[int] = None

    def _kvb_fail(self, reason: str) -> None:
        """Fail the request with ``reason``. Once pages were offered to prefill ranks, kvbridge's
        receiver ends the room and SGLang sees Failed when no sender can still write into
        them (see ``abort``)."""
        mgr: KVBridgeKVManager = self.kv_mgr
        mgr.record_failure(self.bootstrap_room, reason)
        if self._requested and mgr.kv_receiver is not None and mgr.kv_receiver.poll(self.bootstrap_room) not in TERMINAL:
            mgr.kv_receiver.abort(self.bootstrap_room, reason)
            return
        mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def note_transfer_tokens(self, num_tokens: int) -> None:
        """Decode scheduler (kvbridge's hook on ``DecodePreallocQueue._send_kv_metadata``),
        right before ``send_metadata``: the pages it passes hold ``num_tokens`` tokens
        (the prompt past ``decode_prefix_len``; the last page may be partly used)."""
        self._transfer_tokens = int(num_tokens)

    @_fails_the_request()
    def init(self, prefill_dp_rank: int):
        """Decode scheduler, once the prefill's parallel info is known: resolve the prefill
        ranks to pull from; a prefill this decode cannot pair with fails the request here."""
        refusal = self.kv_mgr.kvb_refusal(self.bootstrap_addr)
        if refusal and self.conclude_state is None:
            return self._kvb_fail(refusal)
        super().init(prefill_dp_rank)

    @_fails_the_request()
    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, device_kv_indices=None):
        mgr: KVBridgeKVManager = self.kv_mgr
        room = self.bootstrap_room
        fail = self._kvb_fail
        if self.conclude_state == KVPoll.Failed:
            return
        if getattr(self, "bootstrap_infos", None) is None:
            return fail(f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
        if destination != KVTransferDestination.DEVICE:
            return fail("kvbridge does not receive into host memory (decode host KV destinations)")
        if state_indices is not None and any(s is not None for s in state_indices):
            return fail("kvbridge does not move SGLang state pools (mamba/SWA/DSA)")
        raw = [info.get("kvbridge") for info in self.bootstrap_infos]
        if not all(isinstance(r, dict) and r.get("endpoint") for r in raw):
            return fail(f"prefill at {self.bootstrap_addr} publishes no kvbridge endpoint (not a kvbridge backend?)")
        try:
            records = [P.RankRecord.parse(r, f"prefill at {self.bootstrap_addr}: rank record") for r in raw]
        except P.ProtocolError as e:
            return fail(f"kvbridge: {e}")
        endpoints = list(dict.fromkeys(r.endpoint for r in records))
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        ps = int(mgr.kv_args.page_size)
        prefix = int(decode_prefix_len or 0)
        if pages.size == 0:
            return fail("kvbridge: no pages to receive")
        # the prompt's tokens past the prefix; without the scheduler's count, whole pages
        ntok = self._transfer_tokens if self._transfer_tokens is not None else pages.size * ps
        if not (pages.size - 1) * ps < ntok <= pages.size * ps:
            return fail(f"kvbridge: {pages.size} pages of {ps} tokens do not fit {ntok} tokens past the prefix")
        if mgr.kvb_gate is not None:
            verdict = mgr.kvb_gate.check(prefix + ntok, prefix)
            if not verdict.move:
                try:
                    mgr.ensure_receiver(records[0].layout).decline(room, endpoints, verdict.reason, label=verdict.label)
                except (ValueError, LayoutError, P.ProtocolError) as e:
                    log.warning("kvbridge: room %s: cannot tell the prefill it was declined: %s", room, e)
                log.info("kvbridge: room %s not pulled: %s", room, verdict.reason)
                self._kvb_declined = True
                return fail(verdict.reason)
        try:
            recv = mgr.ensure_receiver(records[0].layout)
            recv.forget(room)
            recv.request(room, endpoints, pages, prefix, prefix + ntok, first_token=prefix,
                         receivers=int(self.required_dst_info_num or 1), deadline_s=mgr.waiting_timeout)
        except (ValueError, LayoutError, P.ProtocolError) as e:
            return fail(f"kvbridge: {e}")
        self._requested = True
        self._aux_index = aux_index
        self.init_time = time.time()

    def _get_bootstrap_info_from_server(self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank):
        """Common's fetch of one prefill rank's route; with the deployment's keyring its
        kvbridge record, ``rank_ip`` and ``rank_port`` are taken from the answer's seal
        (``kvbridge.common.bootstrap.open_route_info``), and an answer without a valid one
        loses its record (counted, logged): the request then fails naming it."""
        info = super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
        keyring = getattr(self.kv_mgr, "kvb_keyring", None)
        if info is None or keyring is None:
            return info
        key = (prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
        try:
            return open_route_info(info, key, keyring)
        except (AuthError, TypeError, ValueError) as e:
            refused(e if isinstance(e, AuthError) else AuthError("bad_message", str(e)),
                    f"bootstrap server {self.bootstrap_addr}: rank {list(key)}")
            return {**info, "kvbridge": None}

    def _send_abort_notification(self, *, force_arm: bool = False):
        """SGLang's ABORT notice to each prefill rank (Common's, as in SGLang 0.5.23), with
        one more frame: a seal (``ABORT_DOMAIN``) over the rank's address and the notice, so
        the kvbridge prefill acts only on notices from key holders. No keyring: Common's."""
        mgr: KVBridgeKVManager = self.kv_mgr
        keyring = getattr(mgr, "kvb_keyring", None)
        if keyring is None:
            return super()._send_abort_notification(force_arm=force_arm)
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            self._abort_generation = mgr.register_deferred_abort_room(self.bootstrap_room)
        for info in self.bootstrap_infos:
            try:
                frames = AbortNotification(room=self.bootstrap_room, decode_ip=mgr.local_ip, decode_port=mgr.rank_port,
                                           generation=self._abort_generation).to_zmq()
                target = f"{info.get('rank_ip')}:{info.get('rank_port')}"
                frames.append(keyring.seal(abort_seal_payload(target, frames), ABORT_DOMAIN))
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart(frames)
            except Exception as e:  # best effort, as Common's: kvbridge's own abort travels on its channel
                log.debug("kvbridge: room %s: ABORT notice to %s:%s not sent: %s", self.bootstrap_room,
                          info.get("rank_ip"), info.get("rank_port"), e)

    @_fails_the_request(result=KVPoll.Failed)
    def poll(self) -> KVPoll:
        """Decode scheduler, every pass of its prealloc and transfer queues: the request's state."""
        return super().poll()

    def _poll(self) -> KVPoll:
        mgr: KVBridgeKVManager = self.kv_mgr
        if self.conclude_state is None and self._requested:
            room = self.bootstrap_room
            st = mgr.kv_receiver.poll(room)
            if st is RoomState.SUCCESS and mgr.request_status.get(room) not in (KVPoll.Success, KVPoll.Failed):
                try:
                    if self._aux_index is not None:
                        mgr.write_aux_row(self._aux_index, mgr.kv_receiver.aux(room), room)
                    mgr.update_status(room, KVPoll.Success)
                except Exception as e:  # a malformed row must fail the request, not the scheduler
                    mgr.record_failure(room, f"kvbridge: metadata row: {e!r}")
                    mgr.update_status(room, KVPoll.Failed)
            elif st is RoomState.FAILED and (mgr.enable_deferred_decode_kv_release or mgr.kv_receiver.settled(room)):
                # with SGLang's deferred release its pages stay held until is_abort_release_safe;
                # without it SGLang frees them at once: Failed only once no sender can write there
                mgr.record_failure(room, mgr.kv_receiver.failure_reason(room))
                mgr.update_status(room, KVPoll.Failed)
                # the prefill ranks' records may be stale (one restarted behind the same
                # bootstrap address): the next request asks the bootstrap server again
                self.invalidate_cached_bootstrap_infos()
        return super()._poll()

    @_fails_the_request()
    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Decode transfer queue, for a request that failed on its own account (another TP
        rank's failure, a restore failure) before it holds the pages: the kvbridge room ends
        too, so its senders stop and prove themselves quiet (see ``is_abort_release_safe``)."""
        mgr: KVBridgeKVManager = self.kv_mgr
        if self._kvb_declined:  # kvbridge's decline told the prefill ranks, with its reason; no pages were offered
            return
        if self._requested and mgr.kv_receiver is not None and mgr.kv_receiver.poll(self.bootstrap_room) not in TERMINAL:
            mgr.kv_receiver.abort(self.bootstrap_room, "the decode engine failed the request")
        super().ensure_abort_notified(force_arm=force_arm)

    @_fails_the_request()
    def abort(self):
        """SGLang's AbortReq (or its waiting timeout). Once pages were offered to prefill
        ranks, the room ends and Failed is reported within ``quiesce_s``; the pages go back
        only when no sender can still write into them (SGLang's deferred release, held by
        ``is_abort_release_safe``; without it, Failed waits for that proof)."""
        if not self._requested or self.conclude_state is not None:
            return super().abort()
        room = self.bootstrap_room
        self.kv_mgr.kv_receiver.abort(room, "aborted by decode (AbortReq)")
        self.ensure_abort_notified()  # SGLang's own abort notice to the prefill ranks too

    def _check_waiting_timeout(self) -> Optional[KVPoll]:
        if not self._requested or self.init_time is None or time.time() - self.init_time < self.kv_mgr.waiting_timeout:
            return super()._check_waiting_timeout()
        self.kv_mgr.kv_receiver.abort(self.bootstrap_room, f"timed out after {self.kv_mgr.waiting_timeout:.1f} s "
                                      "waiting for the prefill's KV")
        return None  # Failed once the receiver quiesced (see abort)

    @_fails_the_request()
    def clear(self) -> None:
        """Decode scheduler, when the request leaves its queues: drop the room's bookkeeping."""
        super().clear()

    def _clear(self) -> None:
        super()._clear()
        if self._requested and self.kv_mgr.kv_receiver is not None:
            self.kv_mgr.kv_receiver.forget(self.bootstrap_room)
