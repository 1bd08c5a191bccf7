"""The per-rank KV manager of the kvbridge SGLang backend (prefill and decode).

See ``conn`` for the backend as a whole.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import threading
import time
from typing import Any, List, Optional

import msgspec
import numpy as np
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.common.conn import ABORT_TAG, CommonKVManager, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.network import get_local_ip_auto

from kvbridge.common.auth import AuthError, check_bind
from kvbridge.common.bootstrap import refused, seal_record
from kvbridge.common.handoff import KVReceiver, KVSender, RoomState
from kvbridge.common.protocol import LayoutDescription, RankRecord
from kvbridge.common.rank import BridgeRank
from kvbridge.layout import SCALED_DTYPES, KVLayout, LayoutError, tp_head_slice

from .config import SglangBridgeConfig
from .geometry import layout_from_kv_args, names_kv_dtype, resolve_kv_dtype, served_model_config
from .scales import kv_scales
from .hooks import install_decode_hooks, install_prefill_hooks
from .layerwise import layerwise_wanted

__all__ = ["KVBridgeKVManager", "REGISTER_TAG", "AUX_ROWS", "AUX_LENS", "ABORT_DOMAIN", "abort_seal_payload"]

log = logging.getLogger(__name__)

REGISTER_TAG = b"KVBRIDGE_REGISTER"
REFUSAL_RECHECK_S = 5.0  # decode: a prefill address SGLang refused is asked again after this long
AUX_ROWS = "sglang_aux_rows"  # base64 of the prefill's metadata row, buffer after buffer
AUX_LENS = "sglang_aux_lens"  # bytes of each buffer's row, to check the decode's rows agree
ABORT_DOMAIN = b"sglang-abort"  # kvbridge.common.auth domain of the seal on SGLang's ABORT notices


def abort_seal_payload(target: str, frames: List[bytes]) -> bytes:
    """What the seal on an ABORT notice covers: the prefill rank it is for
    (``rank_ip:rank_port``, as registered) and every frame before the seal."""
    return b"\0".join([target.encode("ascii", "replace"), *(bytes(f) for f in frames)])


class KVBridgeKVManager(CommonKVManager):
    """One per scheduler rank (prefill or decode), built by SGLang's
    ``_init_kv_manager`` (prefill.py / decode.py) with the rank's KVArgs.

    Prefill: owns a kvbridge ``KVSender`` whose control endpoint goes into the rank's
    bootstrap registration. Decode: owns a kvbridge ``KVReceiver`` of its own pool's
    layout, built at once (decode.py fills ``kv_head_num`` only for its staging path, so
    the head count comes from the served model's config; only when that cannot be read,
    from the first prefill's geometry).
    """

    supports_host_destination = False
    # SGLang's deferred decode release: a failed request's pages are held until
    # ``is_abort_release_safe`` says so (kvbridge's release rule; SGLang's own timer is
    # lifted for kvbridge's rooms, see hooks.kvbridge_resolve_deferred_releases)
    supports_deferred_decode_kv_release = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend: Optional[bool] = False):
        # Common's __init__ registers a prefill rank with the bootstrap server, so the
        # kvbridge side (whose endpoint goes into that registration) comes first.
        par = get_parallel()
        self._kvb_tp = (int(par.attn_tp_rank), int(par.attn_tp_size))
        self._kvb_mla = bool(is_mla_backend)
        # the served model's config, read only where KVArgs lack what kvbridge needs: the
        # decode's KV head count (MHA) and the dtype under "auto"
        needs_model = (disaggregation_mode == DisaggregationMode.DECODE and not self._kvb_mla
                       and not getattr(args, "kv_head_num", None))
        if needs_model or not names_kv_dtype(args, server_args):
            self._kvb_model = served_model_config(server_args)
        else:
            self._kvb_model = None
        self._kvb_dtype = resolve_kv_dtype(args, server_args, getattr(self._kvb_model, "dtype", None))
        self._kvb_decode = disaggregation_mode == DisaggregationMode.DECODE
        self._kvb_refused: dict[str, tuple[str, float]] = {}  # decode: prefill address -> (why SGLang refused it, when)
        self._kvb_lock = threading.Lock()
        self._kvb_closed = threading.Event()
        timeout = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()) + float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        # the shared settings (docs/settings.md): handoff timing, link (the plans' costs), cost gate,
        # recv_staging_bytes (what a decode rank's receiver offers for staged_recv plans)
        decode = disaggregation_mode == DisaggregationMode.DECODE
        sglang_host = get_local_ip_auto()  # where SGLang binds this rank's sockets; kvbridge's by default
        self.kvb_settings = SglangBridgeConfig.load(ib_device=getattr(args, "ib_device", None) or "",
                                                    sglang_timeout_s=timeout, host=sglang_host)
        self._kvb_host = self.kvb_settings.host
        self.kvb_gate = self.kvb_settings.cost_gate(server_args) if decode else None
        # every rank record and ABORT notice sealed with the deployment's secret (None: auth off);
        # a prefill's sender binds self._kvb_host and its Common PULL socket (ABORT notices)
        # SGLang's address: a routable one is refused without a secret unless allow_insecure (ValueError)
        self.kvb_keyring = self.kvb_settings.keyring()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            for host in dict.fromkeys((self._kvb_host, sglang_host)):
                check_bind(host, self.kvb_settings.secret, self.kvb_settings.allow_insecure,
                           "the kvbridge SGLang prefill (its control endpoint and ABORT socket)")
        self.kvb_rank = BridgeRank(self.kvb_settings, "sglang")
        self.transport = self.kvb_rank.transport
        self.kv_sender: Optional[KVSender] = None
        self.kv_receiver: Optional[KVReceiver] = None
        self.layout: Optional[KVLayout] = None
        self.kvb_layerwise_chooser = None  # prefill with layerwise "auto": the per-request decision
        self.kvb_streamer = None  # prefill with layerwise on: kvbridge.adapters.sglang.layerwise.LayerStreamer
        self._kvb_aux_regs = False
        try:
            if disaggregation_mode == DisaggregationMode.PREFILL:
                self.layout = self._make_layout(args)
                self.kv_sender = self.kvb_rank.start_sender(self.layout)
            elif self._kvb_mla or getattr(args, "kv_head_num", None):
                self._make_receiver(args)
            else:
                self._make_own_receiver(args)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            if disaggregation_mode == DisaggregationMode.DECODE:
                install_decode_hooks()
            elif layerwise_wanted(self.kvb_settings):
                self.kvb_layerwise_chooser = self.kvb_settings.layerwise_chooser(server_args)
                self.kvb_streamer = install_prefill_hooks(self, self.kvb_owns)
        except Exception:
            self._close_kvbridge()
            raise
        if disaggregation_mode == DisaggregationMode.PREFILL:
            threading.Thread(target=self._prefill_control_loop, daemon=True, name="kvbridge-sglang-ctl").start()
        log.info("kvbridge %s manager up: tp %d/%d, %s, endpoint %s", disaggregation_mode.value,
                 self._kvb_tp[0], self._kvb_tp[1], self.layout, self.kv_sender.endpoint if self.kv_sender else "-")

    # -- deferred decode release (SGLang's DecodeTransferQueue) ------------------------
    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Decode scheduler, each pass, for a failed request whose pages it holds: whether
        they may go back, i.e. no prefill rank can still write into them (acknowledged with
        nothing in flight, or gone). SGLang's count of its own ABORT_ACKs is not the proof."""
        return self.kv_receiver is None or self.kv_receiver.settled(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Decode scheduler, once it released a held request's pages."""
        super().clear_deferred_abort_state(bootstrap_room)
        if self.kv_receiver is not None:
            self.kv_receiver.forget(bootstrap_room)

    # -- geometry --------------------------------------------------------------------
    def _make_layout(self, args: KVArgs, heads: int | None = None, total: int | None = None) -> KVLayout:
        lay = layout_from_kv_args(args, is_mla=self._kvb_mla, dtype=self._kvb_dtype, tp_rank=self._kvb_tp[0],
                                  tp_size=self._kvb_tp[1], heads=heads, total_heads=total)
        if lay.dtype not in SCALED_DTYPES:
            return lay
        scales = kv_scales(lay.num_layers, lay.layer_offset, lay.kv_factor, decode=self._kvb_decode)
        if scales is None:
            raise LayoutError(f"the {lay.dtype} KV cache's scales are unknown (the scheduler's model was not seen "
                              "before its KV manager was built); kvbridge moves an fp8 cache only with its scales")
        return lay.with_scales(scales)

    def _make_receiver(self, args: KVArgs, heads: int | None = None, total: int | None = None) -> KVReceiver:
        with self._kvb_lock:
            if self.kv_receiver is None:
                self.layout = self._make_layout(args, heads, total)
                self.kv_receiver = self.kvb_rank.start_receiver(self.layout)
            return self.kv_receiver

    def _make_own_receiver(self, args: KVArgs) -> None:
        """Decode, MHA without ``kv_head_num`` in KVArgs: the receiver from this server's own
        model (its total KV heads, this rank's TP share), so that its layout never depends
        on which prefill it meets first: a prefill of another model is then refused with
        the real difference named."""
        total = self._kvb_model.get_total_num_kv_heads() if self._kvb_model is not None else None
        if not total:
            log.info("kvbridge: decode KV heads unknown until a prefill is met (no model config)")
            return
        try:
            _, heads = tp_head_slice(int(total), self._kvb_tp[1], self._kvb_tp[0])
            self._make_receiver(args, heads, int(total))
        except LayoutError as e:
            log.warning("kvbridge: decode pool does not match its model's %s KV heads (%s); its layout will "
                        "follow the first prefill met", total, e)

    def ensure_receiver(self, peer_layout: LayoutDescription) -> KVReceiver:
        """Decode: the receiver, built on first use from a prefill rank's geometry
        (total heads and head_dim) and this rank's TP slot when KVArgs lack head counts."""
        if self.kv_receiver is not None:
            return self.kv_receiver
        total = peer_layout.total_heads
        _, heads = tp_head_slice(total, self._kvb_tp[1], self._kvb_tp[0])
        return self._make_receiver(self.kv_args, heads, total)

    # -- bootstrap registration (prefill) ---------------------------------------------
    def kvbridge_record(self) -> RankRecord:
        """What this prefill rank publishes for kvbridge receivers."""
        return self.kvb_rank.record()

    def _register_topology_row(self, url: str, payload):
        if self.kv_sender is not None:
            payload = {**payload, "kvbridge": msgspec.to_builtins(self.kvbridge_record())}
        if self.kvb_keyring is None:
            return super()._register_topology_row(url, payload)
        # sealed (kvbridge.common.bootstrap). Common's loop retries the same body, but a seal
        # is taken once and lives replay_window_s: the same retries here, each sealed afresh
        import requests

        delay = 1.0
        for attempt in range(5):
            try:
                r = requests.put(url, json=seal_record(payload, self.kvb_keyring), timeout=5)
                if r.status_code == 200:
                    return
                log.warning("kvbridge: prefill registration attempt %d/5 refused: HTTP %d %s", attempt + 1,
                            r.status_code, r.text[:300])
            except Exception as e:
                log.warning("kvbridge: prefill registration attempt %d/5 failed: %s", attempt + 1, e)
            if attempt < 4:
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
        log.error("kvbridge: prefill rank failed to register with the bootstrap server %s after 5 tries", url)

    # -- pairing with a prefill instance (decode) ---------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode scheduler, on its event loop, for each prefill address its new requests
        name (``_ensure_prefill_info``, decode.py): fetch and cache the prefill instance's
        parallel info. SGLang's checks raise on what they refuse to pair, which would take
        the scheduler down; here a refusal is kept for the address, each request naming
        it fails with the reason (``KVBridgeKVReceiver.init``), and the address is asked
        again ``REFUSAL_RECHECK_S`` after the refusal. Returns False while the info cannot
        be fetched (SGLang retries, then aborts the requests). Never raises."""
        refused = self._kvb_refused.get(bootstrap_addr)
        if refused is not None and time.monotonic() - refused[1] >= REFUSAL_RECHECK_S:
            self._kvb_refused.pop(bootstrap_addr, None)
            self.prefill_info_table.pop(bootstrap_addr, None)
        try:
            return super().try_ensure_parallel_info(bootstrap_addr)
        except Exception as e:  # RuntimeError / AssertionError from SGLang's pairing checks
            reason = f"kvbridge: the prefill at {bootstrap_addr} cannot pair with this decode server: {e}"
            log.error("%s (its requests fail; asked again in %.0f s)", reason, REFUSAL_RECHECK_S)
            self._kvb_refused[bootstrap_addr] = (reason, time.monotonic())
            # a stand-in entry lets the scheduler hand the requests to their receivers
            # (data parallel rank 0), which fail them with the reason
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=None, kv_cache_dtype=None,
                follow_bootstrap_room=True)
            return True

    def kvb_owns(self, sender: Any) -> bool:
        """Whether ``sender`` (a request's ``disagg_kv_sender``) is one of this rank's
        kvbridge senders: what the layer streamer arms."""
        return getattr(sender, "kv_mgr", None) is self

    def kvb_refusal(self, bootstrap_addr: str) -> str:
        """Why this decode cannot pair with the prefill at ``bootstrap_addr`` ('' if it can)."""
        refused = self._kvb_refused.get(bootstrap_addr)
        return refused[0] if refused is not None else ""

    # -- the decode's SGLang registration and abort notices (prefill) ----------------
    def _prefill_control_loop(self) -> None:
        """Drain the Common PULL socket: decode ranks send their registration there once
        per prefill rank and SGLang-style ABORT notices; kvbridge's own channel carries
        everything else."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._kvb_closed.is_set():
            try:
                if not poller.poll(200):
                    continue
                msg = self.server_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._kvb_closed.is_set():
                    return
                continue
            if not msg:
                continue
            if msg[0] == REGISTER_TAG:
                log.debug("kvbridge: decode rank %s registered", msg[1:2])
            elif msg[0] == ABORT_TAG:
                if not self._abort_is_sealed(msg):
                    continue
                try:
                    room = int(msg[1].decode("ascii"))
                except (IndexError, ValueError, UnicodeDecodeError):
                    continue
                if self.kv_sender is not None and self.kv_sender.poll(room) not in (RoomState.SUCCESS, RoomState.FAILED):
                    self.kv_sender.abort(room, "aborted by decode (SGLang abort notice)")
            else:
                log.debug("kvbridge: ignored control frame %r", msg[0][:32])

    def _abort_is_sealed(self, msg: List[bytes]) -> bool:
        """With a keyring: whether an ABORT notice ends with a valid seal (``ABORT_DOMAIN``)
        over this rank's address and the frames before it; a refused one is counted in
        ``kvbridge_refused_frames_total{channel="sglang_abort"}`` and logged, rate-limited."""
        if self.kvb_keyring is None:
            return True
        try:
            if len(msg) < 3:
                raise AuthError("unsigned", "ABORT notice without a seal frame")
            target = f"{self.local_ip}:{self.rank_port}"
            if self.kvb_keyring.open(msg[-1], ABORT_DOMAIN, 4096) != abort_seal_payload(target, msg[:-1]):
                raise AuthError("bad_tag", f"ABORT notice sealed for another rank or other frames (this rank: {target})")
        except AuthError as e:
            refused(e, "kvbridge SGLang prefill: ABORT notice", channel="sglang_abort")
            return False
        return True

    # -- decode-side hooks of CommonKVReceiver ------------------------------------------
    def build_receiver_registration_message(self) -> List[bytes]:
        return [REGISTER_TAG, self.transport.session_id.encode("ascii")]

    def add_transfer_request(self, *args, **kwargs):  # pragma: no cover - kvbridge sender sends itself
        raise NotImplementedError("KVBridgeKVSender.send hands chunks to kvbridge's KVSender directly")

    # -- metadata rows ------------------------------------------------------------------
    def read_aux_row(self, aux_index: int) -> dict:
        """Prefill: the request's metadata row (SGLang's MetadataBuffers, written by
        ``set_buf`` before the last chunk's send) as kvbridge aux: engine-neutral
        ``output_ids`` / ``cached_tokens`` and the raw row for SGLang receivers."""
        a = self.kv_args
        rows = [ctypes.string_at(p + aux_index * n, n) for p, n in zip(a.aux_data_ptrs, a.aux_item_lens)]
        out_ids = np.frombuffer(rows[0], dtype=np.int32)
        aux = {"output_ids": [int(out_ids[0])], AUX_ROWS: base64.b64encode(b"".join(rows)).decode("ascii"),
               AUX_LENS: [int(n) for n in a.aux_item_lens]}
        if len(rows) > 1:
            aux["cached_tokens"] = int(np.frombuffer(rows[1], dtype=np.int32)[0])
        return aux

    def write_aux_row(self, aux_index: int, aux: dict, room: int) -> None:
        """Decode: write the metadata row the decode scheduler reads after Success
        (``MetadataBuffers.get_buf``: output_ids, cached_tokens, logprobs, spec-decode
        top-k and hidden states, and bootstrap_room, which it checks against the room).
        The prefill's raw row when it has the same buffers; else the engine-neutral
        fields (a non-SGLang prefill): first token, cached tokens, the room."""
        a = self.kv_args
        lens = [int(n) for n in a.aux_item_lens]
        if aux.get(AUX_LENS) == lens and isinstance(aux.get(AUX_ROWS), str):
            blob = base64.b64decode(aux[AUX_ROWS])
            off = 0
            for p, n in zip(a.aux_data_ptrs, lens):
                ctypes.memmove(p + aux_index * n, blob[off : off + n], n)
                off += n
            return
        ids = aux.get("output_ids") or []
        if not ids:
            raise ValueError("the prefill sent no output_ids")
        for p, n in zip(a.aux_data_ptrs, lens):
            ctypes.memset(p + aux_index * n, 0, n)
        ctypes.memmove(a.aux_data_ptrs[0] + aux_index * lens[0], np.asarray(ids[:lens[0] // 4], dtype=np.int32).tobytes(),
                       4 * min(len(ids), lens[0] // 4))
        if len(lens) > 1:
            ctypes.memmove(a.aux_data_ptrs[1] + aux_index * lens[1], np.int32(int(aux.get("cached_tokens", 0))).tobytes(), 4)
        room_buf = self._bootstrap_room_buffer()
        ctypes.memmove(a.aux_data_ptrs[room_buf] + aux_index * lens[room_buf], np.uint64(room).tobytes(), 8)

    def _bootstrap_room_buffer(self) -> int:
        n = len(self.kv_args.aux_data_ptrs)
        checksum = bool(getattr(self.server_args, "disaggregation_enable_kv_checksum", False))
        return n - 2 if checksum else n - 1

    # -- teardown -------------------------------------------------------------------------
    supports_role_switch = False

    def _close_kvbridge(self) -> None:
        self._kvb_closed.set()
        if getattr(self, "kvb_streamer", None) is not None:
            self.kvb_streamer.close()
        rank = getattr(self, "kvb_rank", None)
        if rank is not None:
            rank.close()

    def close(self) -> None:
        """Stop kvbridge's sender/receiver and transport (tests, shutdown)."""
        self._close_kvbridge()
        try:
            self.server_socket.close(linger=0)
        except Exception:  # pragma: no cover
            pass
