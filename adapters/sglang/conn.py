"""kvbridge as an SGLang transfer backend: manager, sender, receiver, bootstrap server.

Discovery is SGLang's own: the classes subclass ``CommonKVManager`` / ``CommonKVSender``
/ ``CommonKVReceiver`` / ``CommonKVBootstrapServer`` (``srt/disaggregation/common/conn.py``),
so the router and decode servers find prefill ranks through the prefill's bootstrap
server as with any built-in backend. Each prefill rank adds a ``kvbridge`` record to
what it registers there (its kvbridge control endpoint, Mooncake session and layout);
the bootstrap server returns it with the rank's route and lists all of them at
``GET /kvbridge/ranks``, so any kvbridge receiver, SGLang or not, can find them.

The per-room exchange and the bytes are kvbridge's: the decode rank's ``KVReceiver``
sends each prefill rank it pulls from a ``TransferRequest`` (its layout and page ids),
the prefill rank's ``KVSender`` plans (head slices for different TP, staging when
layouts differ) and writes over the Mooncake transport after every prefill chunk, and
reports ``TransferDone`` with the first output token and the metadata row.

Cost gate (decode, off by default; ``KVBRIDGE_COST_LINK`` turns it on, see
``kvbridge.common.gate``): SGLang 0.5.23's disaggregated decode cannot compute a prompt
itself. Its scheduler only builds PREBUILT batches from requests whose KV arrived
(``_get_new_prebuilt_batch`` / ``prepare_for_prebuilt`` in disaggregation/decode.py: no
extend forward runs there), and a receiver that reports ``KVPoll.Failed`` makes it abort
the request (``prepare_abort``, HTTP 500 with the failure reason) and free its pages.
So below break-even the receiver fails fast in ``send_metadata``, before asking any
prefill rank for bytes (no page is written), with a reason starting ``recompute:
below break-even``; the prefill ranks are told (the room is declined), so they release
the room; the decision is logged and counted in
``kvbridge_fallbacks_total{role="receiver", reason="below_break_even"}``. A router that
sees that reason sends the request to a non-disaggregated server; one that wants to
know first asks the same cost model (``kvbridge plan`` or ``CostGate.check``).

Units: SGLang exchanges PAGE ids (page 0 is padding), each side in its OWN page size;
kvbridge's ranges are in tokens, so the two servers' page sizes need not agree. The
decode asks for exactly the prompt's tokens past ``decode_prefix_len`` (the count comes
from the decode scheduler's ``_send_kv_metadata``, see ``note_transfer_tokens``), into its
pages; the prefill sends from ``decode_prefix_len`` rounded down to its own page (its
scheduler slices its page list from there), each chunk as the exact tokens
``num_kv_tokens`` names; kvbridge writes only tokens the decode does not hold.

Pairing: SGLang's ``try_ensure_parallel_info`` refuses (raises, on the decode
scheduler's event loop) prefill servers whose page size or KV dtype differs. kvbridge's
bootstrap server leaves both out of its server-wide answer (each rank's kvbridge record
carries its layout, page size and dtype included, and kvbridge checks the layouts per
request, naming every mismatch), and the decode manager turns anything SGLang still
refuses into a failure of each request to that prefill, never an exception.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import json
import logging
import os
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch
import zmq
from aiohttp import web

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.network import get_local_ip_auto

from kvbridge.common import protocol as P
from kvbridge.common.bootstrap import rank_record, ranks_payload
from kvbridge.common.handoff import TERMINAL, HandoffConfig, KVReceiver, KVSender, RoomState
from kvbridge.common.transport import MooncakeTransport
from kvbridge.layout import KVLayout, LayoutError, canonical_dtype, sglang_layout_from_buffers, tp_head_slice

__all__ = [
    "KVBridgeKVBootstrapServer",
    "KVBridgeKVManager",
    "KVBridgeKVReceiver",
    "KVBridgeKVSender",
    "layout_from_kv_args",
    "resolve_kv_dtype",
]

log = logging.getLogger(__name__)

REGISTER_TAG = b"KVBRIDGE_REGISTER"
REFUSAL_RECHECK_S = 5.0  # decode: a prefill address SGLang refused is asked again after this long
AUX_ROWS = "sglang_aux_rows"  # base64 of the prefill's metadata row, buffer after buffer
AUX_LENS = "sglang_aux_lens"  # bytes of each buffer's row, to check the decode's rows agree

_STATE = {
    RoomState.FAILED: KVPoll.Failed,
    RoomState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    RoomState.WAITING: KVPoll.WaitingForInput,
    RoomState.TRANSFERRING: KVPoll.Transferring,
    RoomState.SUCCESS: KVPoll.Success,
}


# -- geometry ------------------------------------------------------------------------


def _names_kv_dtype(kv_args: KVArgs, server_args: Any) -> bool:
    """Whether KVArgs or the server arguments name the KV dtype (not 'auto')."""
    for cand in (getattr(kv_args, "kv_cache_dtype_str", None), getattr(server_args, "kv_cache_dtype", None),
                 getattr(server_args, "dtype", None)):
        try:
            if cand is not None and canonical_dtype(cand):
                return True
        except LayoutError:
            continue
    return False


def resolve_kv_dtype(kv_args: KVArgs, server_args: Any = None, model_dtype: Any = None) -> str:
    """The pool's dtype: ``kv_cache_dtype_str`` when it names one ('bfloat16',
    'fp8_e4m3'...), else the model dtype of ``server_args``, else ``model_dtype`` (the
    served model's resolved dtype, for ``--dtype auto``), else raw bytes ('uint8'; the
    layout then counts head_dim in bytes, which moves the same bytes)."""
    for cand in (getattr(kv_args, "kv_cache_dtype_str", None), getattr(server_args, "kv_cache_dtype", None),
                 getattr(server_args, "dtype", None), model_dtype):
        if cand is None:
            continue
        try:
            return canonical_dtype(cand)
        except LayoutError:
            continue
    log.warning("kvbridge: KV dtype %r not resolvable; treating KV as raw bytes",
                getattr(kv_args, "kv_cache_dtype_str", None))
    return "uint8"


def served_model_config(server_args: Any):
    """SGLang's ``ModelConfig`` of the model this server runs (what its scheduler built
    from the same ``server_args``), or None when its config is not on this host (a local
    folder, or a hub model already in the cache): nothing is downloaded here."""
    path = str(getattr(server_args, "model_path", "") or "")
    try:
        if not os.path.isdir(path):
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(path, "config.json"), str):
                return None
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(server_args)
    except Exception as e:
        log.debug("kvbridge: no model config for %r: %s", path, e)
        return None


def _kv_buffers(kv_args: KVArgs) -> tuple[list[int], list[int], list[int]]:
    """The KV pool entries of KVArgs (draft-model entries, appended last, are not moved)."""
    n = len(kv_args.kv_data_ptrs) - int(getattr(kv_args, "num_draft_entries", 0) or 0)
    return list(kv_args.kv_data_ptrs[:n]), list(kv_args.kv_data_lens[:n]), list(kv_args.kv_item_lens[:n])


def layout_from_kv_args(kv_args: KVArgs, *, is_mla: bool, dtype: str, tp_rank: int, tp_size: int,
                        heads: int | None = None, total_heads: int | None = None) -> KVLayout:
    """A rank's KVLayout from SGLang's KVArgs (``kv_data_ptrs/lens/item_lens``,
    ``page_size``, ``kv_head_num``, ``total_kv_head_num``), with tensors aliasing the
    pool memory attached (the sender's repack reads through them)."""
    ptrs, lens, items = _kv_buffers(kv_args)
    heads = heads if heads is not None else getattr(kv_args, "kv_head_num", 1)
    total = total_heads if total_heads is not None else getattr(kv_args, "total_kv_head_num", heads)
    lay = sglang_layout_from_buffers(ptrs, lens, items, kv_args.page_size, heads, total, dtype, is_mla=is_mla,
                                     tp_rank=0 if is_mla else tp_rank, tp_size=None if is_mla else tp_size,
                                     layer_offset=int(getattr(kv_args, "prefill_start_layer", 0) or 0))
    return lay.with_tensors(_alias_regions(lay, getattr(kv_args, "gpu_id", None)))


class _CudaSpan:
    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def _alias_regions(lay: KVLayout, gpu_id: Optional[int]) -> list[torch.Tensor]:
    """uint8 tensors over the layout's regions (no copy), on the pool's device."""
    out = []
    on_gpu = torch.cuda.is_available() and gpu_id is not None and _is_device_ptr(lay.regions[0].addr)
    for r in lay.regions:
        if on_gpu:
            out.append(torch.as_tensor(_CudaSpan(r.addr, r.nbytes), device=f"cuda:{gpu_id}"))
        else:
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr))
            out.append(torch.from_numpy(arr))
    return out


def _is_device_ptr(addr: int) -> bool:
    try:
        attrs = torch.cuda.cudart().cudaPointerGetAttributes(addr)  # type: ignore[attr-defined]
        return int(getattr(attrs, "type", 0)) == 2
    except Exception:  # no runtime binding: assume device memory when CUDA is present
        return True


def _transport_for(kv_args: KVArgs, host: str) -> MooncakeTransport:
    protocol = os.environ.get("KVBRIDGE_PROTOCOL") or os.environ.get("MOONCAKE_PROTOCOL")
    device = getattr(kv_args, "ib_device", None) or ""
    if not protocol:
        protocol = "tcp" if os.environ.get("MC_FORCE_TCP") or not device else "rdma"
    return MooncakeTransport(host, protocol=protocol, device_name=device if protocol != "tcp" else "")


def _gate_from_env(server_args: Any):
    """The decode rank's cost gate from ``KVBRIDGE_COST_*`` (None when ``KVBRIDGE_COST_LINK``
    is unset); the model geometry defaults to the served model's config.json."""
    from kvbridge.common.gate import CostGate

    env = os.environ
    link = env.get("KVBRIDGE_COST_LINK", "")
    if not link:
        return None
    model_path = str(getattr(server_args, "model_path", "") or "")
    default = None
    if os.path.isfile(os.path.join(model_path, "config.json")):
        default = model_path
    elif model_path and not env.get("KVBRIDGE_COST_MODEL"):
        try:  # a hub id SGLang has already fetched
            from transformers import AutoConfig

            default = AutoConfig.from_pretrained(model_path).to_dict()
        except Exception as e:
            log.warning("kvbridge: cost gate: cannot read %s's config: %s", model_path, e)

    def num(name: str) -> float:
        raw = env.get(name, "") or "0"
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None

    return CostGate.from_settings(link, env.get("KVBRIDGE_COST_MODEL", ""), default_model=default,
                                  prefill_tps=num("KVBRIDGE_COST_PREFILL_TPS"),
                                  decode_prefill_tps=num("KVBRIDGE_COST_DECODE_PREFILL_TPS"),
                                  queue_s=num("KVBRIDGE_COST_QUEUE_S"))


# -- manager -------------------------------------------------------------------------


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
        if needs_model or not _names_kv_dtype(args, server_args):
            self._kvb_model = served_model_config(server_args)
        else:
            self._kvb_model = None
        self._kvb_dtype = resolve_kv_dtype(args, server_args, getattr(self._kvb_model, "dtype", None))
        self._kvb_refused: dict[str, tuple[str, float]] = {}  # decode: prefill address -> (why SGLang refused it, when)
        self._kvb_host = get_local_ip_auto()
        self._kvb_lock = threading.Lock()
        self._kvb_closed = threading.Event()
        timeout = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()) + float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        # KVBRIDGE_RECV_STAGING_BYTES: staging a decode rank offers its senders (staged_recv
        # plans, e.g. prefill TP 2 -> decode TP 1 MHA, where direct writes are per token)
        self.kvb_config = HandoffConfig(deadline_s=timeout, model=os.environ.get("KVBRIDGE_MODEL", ""),
                                        peer_timeout_s=float(os.environ.get("KVBRIDGE_PEER_TIMEOUT_S", "10") or 10),
                                        secret=os.environ.get("KVBRIDGE_SECRET", ""),
                                        recv_staging_bytes=int(os.environ.get("KVBRIDGE_RECV_STAGING_BYTES", "0") or 0)
                                        if disaggregation_mode == DisaggregationMode.DECODE else 0)
        self.kvb_gate = _gate_from_env(server_args) if disaggregation_mode == DisaggregationMode.DECODE else None
        self.transport = _transport_for(args, self._kvb_host)
        self.kv_sender: Optional[KVSender] = None
        self.kv_receiver: Optional[KVReceiver] = None
        self.layout: Optional[KVLayout] = None
        self._kvb_aux_regs = False
        try:
            if disaggregation_mode == DisaggregationMode.PREFILL:
                self.layout = self._make_layout(args)
                self.kv_sender = KVSender(self.layout, self.transport, host=self._kvb_host, config=self.kvb_config)
            elif self._kvb_mla or getattr(args, "kv_head_num", None):
                self._make_receiver(args)
            else:
                self._make_own_receiver(args)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            if disaggregation_mode == DisaggregationMode.DECODE:
                from .plugin import install_decode_hooks

                install_decode_hooks()
        except Exception:
            self._close_kvbridge()
            raise
        if disaggregation_mode == DisaggregationMode.PREFILL:
            threading.Thread(target=self._prefill_control_loop, daemon=True, name="kvbridge-sglang-ctl").start()
        log.info("kvbridge %s manager up: tp %d/%d, %s, endpoint %s", disaggregation_mode.value, self._kvb_tp[0],
                 self._kvb_tp[1], self.layout, self.kv_sender.endpoint if self.kv_sender else "-")

    # -- geometry --------------------------------------------------------------------
    def _make_layout(self, args: KVArgs, heads: int | None = None, total: int | None = None) -> KVLayout:
        return layout_from_kv_args(args, is_mla=self._kvb_mla, dtype=self._kvb_dtype, tp_rank=self._kvb_tp[0],
                                   tp_size=self._kvb_tp[1], heads=heads, total_heads=total)

    def _make_receiver(self, args: KVArgs, heads: int | None = None, total: int | None = None) -> KVReceiver:
        with self._kvb_lock:
            if self.kv_receiver is None:
                self.layout = self._make_layout(args, heads, total)
                self.kv_receiver = KVReceiver(self.layout, self.transport, config=self.kvb_config)
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

    def ensure_receiver(self, peer_layout: dict) -> KVReceiver:
        """Decode: the receiver, built on first use from a prefill rank's geometry
        (total heads and head_dim) and this rank's TP slot when KVArgs lack head counts."""
        if self.kv_receiver is not None:
            return self.kv_receiver
        total = int(peer_layout["total_heads"])
        _, heads = tp_head_slice(total, self._kvb_tp[1], self._kvb_tp[0])
        return self._make_receiver(self.kv_args, heads, total)

    # -- bootstrap registration (prefill) ---------------------------------------------
    def kvbridge_record(self) -> dict:
        """What this prefill rank publishes for kvbridge receivers."""
        return rank_record(endpoint=self.kv_sender.endpoint, session=self.transport.session_id, engine="sglang",
                           page_size=int(self.kv_args.page_size), layout=self.layout.describe())

    def _register_topology_row(self, url: str, payload):
        if self.kv_sender is not None:
            payload = {**payload, "kvbridge": self.kvbridge_record()}
        return super()._register_topology_row(url, payload)

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
                try:
                    room = int(msg[1].decode("ascii"))
                except (IndexError, ValueError, UnicodeDecodeError):
                    continue
                if self.kv_sender is not None and self.kv_sender.poll(room) not in (RoomState.SUCCESS, RoomState.FAILED):
                    self.kv_sender.abort(room, "aborted by decode (SGLang abort notice)")
            else:
                log.debug("kvbridge: ignored control frame %r", msg[0][:32])

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
        for side in (getattr(self, "kv_sender", None), getattr(self, "kv_receiver", None)):
            if side is not None:
                try:
                    side.close()
                except Exception:  # pragma: no cover - best effort at shutdown
                    log.exception("kvbridge: closing %s", type(side).__name__)
        tr = getattr(self, "transport", None)
        if tr is not None:
            tr.close()

    def close(self) -> None:
        """Stop kvbridge's sender/receiver and transport (tests, shutdown)."""
        self._close_kvbridge()
        try:
            self.server_socket.close(linger=0)
        except Exception:  # pragma: no cover
            pass


# -- sender (prefill) ----------------------------------------------------------------


def _recorded_failure(obj) -> str:
    """What SGLang recorded as the reason a sender/receiver failed ('' if nothing), without
    consuming it (``failure_exception`` pops it)."""
    mgr = obj.kv_mgr
    with mgr.failure_lock:
        return str(mgr.failure_records.get(obj.bootstrap_room, "") or "")


def _fails_the_request(result: Any = None):
    """For the methods of a sender/receiver that SGLang's scheduler calls on its event loop:
    an exception fails that request (reason recorded, ``_kvb_fail``) and the method returns
    ``result``; it never reaches the scheduler, which would go down with it."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as e:
                log.exception("kvbridge: room %s: %s.%s raised", self.bootstrap_room, type(self).__name__,
                              method.__name__)
                try:
                    self._kvb_fail(f"kvbridge: internal error in {type(self).__name__}.{method.__name__}: {e!r}")
                except Exception:  # pragma: no cover - the last line of defence must not raise either
                    log.exception("kvbridge: room %s: failing it raised too", self.bootstrap_room)
                return result

        return guarded

    return wrap


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
        mgr.kv_sender.send_chunk(self.bootstrap_room, pages, start, start + ntok, last=last, first_token=start, aux=aux)
        self._record_transfer_indices(pages, None)

    @_fails_the_request(result=KVPoll.Failed)
    def poll(self) -> KVPoll:
        """Prefill scheduler, every pass of its bootstrap and inflight queues: the room's
        state (kvbridge's, mapped to KVPoll)."""
        if self.conclude_state is not None:
            return self.conclude_state
        mgr = self.kv_mgr
        if self._added:
            st = mgr.kv_sender.poll(self.bootstrap_room)
            if st is RoomState.FAILED:
                mgr.record_failure(self.bootstrap_room, mgr.kv_sender.failure_reason(self.bootstrap_room))
            if self.bootstrap_room in mgr.request_status:
                mgr.update_status(self.bootstrap_room, _STATE[st])
        out = super().poll()
        if out == KVPoll.Failed and self._added and mgr.kv_sender.poll(self.bootstrap_room) not in (RoomState.SUCCESS,
                                                                                                      RoomState.FAILED):
            # SGLang failed the request itself (e.g. its bootstrap timeout): end the room now,
            # telling any decode rank, rather than holding it open to its deadline
            mgr.kv_sender.abort(self.bootstrap_room, f"the prefill engine failed the request: {_recorded_failure(self)}")
        return out

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


# -- receiver (decode) ---------------------------------------------------------------


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

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._requested = False
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
        records = [info.get("kvbridge") for info in self.bootstrap_infos]
        if not all(isinstance(r, dict) and r.get("endpoint") for r in records):
            return fail(f"prefill at {self.bootstrap_addr} publishes no kvbridge endpoint (not a kvbridge backend?)")
        endpoints = list(dict.fromkeys(r["endpoint"] for r in records))
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
                    mgr.ensure_receiver(records[0]["layout"]).decline(room, endpoints, verdict.reason, label=verdict.label)
                except (ValueError, LayoutError, P.ProtocolError) as e:
                    log.warning("kvbridge: room %s: cannot tell the prefill it was declined: %s", room, e)
                log.info("kvbridge: room %s not pulled: %s", room, verdict.reason)
                return fail(verdict.reason)
        try:
            recv = mgr.ensure_receiver(records[0]["layout"])
            recv.forget(room)
            recv.request(room, endpoints, pages, prefix, prefix + ntok, first_token=prefix,
                         receivers=int(self.required_dst_info_num or 1), deadline_s=mgr.waiting_timeout)
        except (ValueError, LayoutError, P.ProtocolError) as e:
            return fail(f"kvbridge: {e}")
        self._requested = True
        self._aux_index = aux_index
        self.init_time = time.time()

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
            elif st is RoomState.FAILED:
                mgr.record_failure(room, mgr.kv_receiver.failure_reason(room))
                mgr.update_status(room, KVPoll.Failed)
                # the prefill ranks' records may be stale (one restarted behind the same
                # bootstrap address): the next request asks the bootstrap server again
                self.invalidate_cached_bootstrap_infos()
        return super()._poll()

    @_fails_the_request()
    def abort(self):
        """SGLang's AbortReq (or its waiting timeout). Once pages were offered to prefill
        ranks, Failed is reported only when kvbridge's receiver knows no sender can still
        write into them (acknowledged, gone, or ``quiesce_s`` passed): SGLang frees a failed
        request's pages as soon as it polls Failed (this backend has no deferred release)."""
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


# -- bootstrap server (prefill instance) ----------------------------------------------


class KVBridgeKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server, started once per prefill instance by
    ``start_disagg_service`` (tokenizer side), plus each rank's kvbridge record: returned
    with the rank's ``GET /route`` answer and listed at ``GET /kvbridge/ranks``."""

    def __init__(self, host: str, port: int):
        self.kvbridge_ranks: dict[tuple[int, int, int, int], dict] = {}
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_get("/kvbridge/ranks", self._handle_kvbridge_ranks)

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()  # aiohttp caches the body; Common reads it again
        resp = await super()._handle_route_put(request)
        rec = data.get("kvbridge")
        if resp.status == 200 and isinstance(rec, dict):
            dp = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (int(dp), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
            async with self.lock:
                self.kvbridge_ranks[key] = {**rec, "rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
        return resp

    async def _handle_route_get(self, request: web.Request):
        resp = await super()._handle_route_get(request)
        if resp.status != 200:
            return resp
        q = request.query
        try:
            key = tuple(int(q[k]) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except (KeyError, ValueError):
            return resp
        if key == (-1, -1, -1, -1):
            # The server-wide answer (parsed strictly: PrefillServerInfo(**data)). Page size
            # and KV dtype are left out: SGLang's decode refuses (raises) when they differ
            # from its own, but kvbridge bridges page sizes and checks dtypes per request,
            # from each rank's layout (its record below), naming what differs.
            body = json.loads(resp.body)
            body["page_size"] = None
            body["kv_cache_dtype"] = None
            return web.json_response(body, status=200)
        rec = self.kvbridge_ranks.get(key)
        if rec is None:
            return resp
        body = json.loads(resp.body)
        body["kvbridge"] = {k: v for k, v in rec.items() if k not in ("rank_ip", "rank_port")}
        return web.json_response(body, status=200)

    async def _handle_kvbridge_ranks(self, request: web.Request):
        async with self.lock:
            ranks = dict(self.kvbridge_ranks)
        return web.json_response(ranks_payload(
            ranks, ready=self._is_ready(), attn_tp_size=self.attn_tp_size, attn_cp_size=self.attn_cp_size,
            dp_size=self.dp_size, pp_size=self.pp_size, page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype))
