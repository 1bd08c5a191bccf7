"""The worker side of the kvbridge vLLM connector (``KVBridgeWorker``).

vLLM builds the connector with ``KVConnectorRole.WORKER`` in every worker process (one
per TP rank) and calls it from the model runner's connector context
(``KVConnectorModelRunnerMixin._get_kv_connector_output``) every step, with or without a
forward: ``bind_connector_metadata`` (the scheduler's orders), ``start_load_kv`` (after
the forward for asynchronous loads), ``wait_for_save``, ``get_transfer_results``,
``clear_connector_metadata``. ``register_kv_caches`` is called once, after the KV cache
is allocated, with every attention layer's cache tensor.

The worker owns the rank's KVLayout (from those tensors and the attention layers: the
CPU backend's per ISA, every other backend's from vLLM's logical views; what it cannot
move is refused by name), the Mooncake transport,
a kvbridge ``KVSender`` (prefill) and ``KVReceiver`` (decode), and on TP rank 0 of a
prefill the SGLang-compatible bootstrap server where every rank registers its record.
Loads and sends run on kvbridge's threads; their ends are reported in
``get_transfer_results``. A decode worker finds a prefill's ranks through its bootstrap
server on a thread of its own, so a slow or absent prefill never blocks a step.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.common.bootstrap import BootstrapError, BootstrapServer, fetch_ranks, rank_records, seal_record
from kvbridge.common.handoff import KVReceiver, KVSender
from kvbridge.common.orders import Drop, Load, Open, Send
from kvbridge.common.protocol import RankRecord
from kvbridge.common.rank import BridgeRank
from kvbridge.layout import (SCALED_DTYPES, KVLayout, LayoutError, tp_head_slice, vllm_cpu_layout, vllm_cpu_mla_layout,
                             vllm_paged_layout)

from .config import ConfigError, VllmBridgeConfig
from .scheduler import KVBridgeMetadata

__all__ = ["KVBridgeWorker", "layout_from_vllm"]

log = logging.getLogger(__name__)

_KEEP = 4096
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA")  # their kernels lay a block out their own way (per ISA); others: logical views


def layout_from_vllm(kv_caches: dict[str, torch.Tensor], vllm_config: Any, *, tp_rank: int = 0,
                     tp_size: int = 1) -> KVLayout:
    """This rank's KVLayout from ``register_kv_caches``' tensors (ordered by layer index)
    and the attention layers behind them; LayoutError naming a layer, backend, ISA or
    cache dtype kvbridge does not handle.

    The CPU backends' caches are described per ISA (``vllm_cpu_layout``,
    ``vllm_cpu_mla_layout``). Every other backend gets vLLM's logical ``[B, H, N, C]``
    views in whichever ``KVCacheLayout`` vLLM chose (``vllm_paged_layout``: the strides
    are read from the views), K then V inside ``C`` (MLA: the latent row); fp8 caches
    carry each layer's ``_k_scale`` / ``_v_scale`` (per tensor or per head)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    layers = dict(get_layers_from_vllm_config(vllm_config, Attention, list(kv_caches)))
    mla_names: set[str] = set()
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        mla_layers = get_layers_from_vllm_config(vllm_config, MLAAttention, list(kv_caches))
        layers.update(mla_layers)
        mla_names = set(mla_layers)
    except ImportError:  # a vLLM without that module: plain attention only
        pass
    backends, isas = set(), set()
    for name in kv_caches:
        layer = layers.get(name)
        if layer is None:
            raise LayoutError(f"vLLM layer {name!r} is neither attention nor MLA (Mamba, linear attention, an "
                              "indexer cache...): not supported")
        backend = layer.attn_backend
        backends.add(backend.get_name() if hasattr(backend, "get_name") else type(backend).__name__)
        isas.add(getattr(layer, "isa", None))
    if len(backends) != 1:
        raise LayoutError(f"vLLM layers use different attention backends {sorted(backends)}: not supported")

    def index(name: str) -> int:
        nums = re.findall(r"\.(\d+)\.", f".{name}.")
        return int(nums[0]) if nums else 0

    names = sorted(kv_caches, key=index)
    backend = next(iter(backends))
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    if backend not in CPU_BACKENDS:
        return _logical_layout(kv_caches, names, layers, mla=bool(mla_names & set(names)), backend=backend,
                               cache_dtype=cache_dtype, total=total, tp_rank=tp_rank, tp_size=tp_size,
                               block_size=int(vllm_config.cache_config.block_size))
    if cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise LayoutError(f"vLLM kv_cache_dtype {cache_dtype!r} is not supported by kvbridge on the CPU backend")
    if backend == "CPU_MLA":
        return vllm_cpu_mla_layout([kv_caches[n] for n in names])
    if len(isas) != 1:
        raise LayoutError(f"vLLM CPU attention layers use different ISAs {sorted(map(str, isas))}")
    return vllm_cpu_layout([kv_caches[n] for n in names], isa=str(isas.pop()), total_heads=total, tp_rank=tp_rank,
                           tp_size=tp_size)


def _logical_layout(kv_caches: dict[str, torch.Tensor], names: list[str], layers: dict[str, Any], *, mla: bool,
                    backend: str, cache_dtype: str, total: int, tp_rank: int, tp_size: int,
                    block_size: int | None = None) -> KVLayout:
    """The layout of a GPU backend's logical views, with an fp8 cache's scales. Views
    cut into kernel blocks smaller than vLLM's blocks (the block ids the scheduler hands
    out) are refused."""
    views = [kv_caches[n] for n in names]
    if block_size and views[0].dim() == 4 and int(views[0].shape[2]) != block_size:
        raise LayoutError(f"vLLM {backend} cache views hold {int(views[0].shape[2])} tokens per block, vLLM's blocks "
                          f"{block_size}: kernel blocks inside vLLM's blocks are not supported (set --block-size "
                          f"{int(views[0].shape[2])})")
    first = layers[names[0]]
    dtype = None
    if cache_dtype.startswith("fp8"):
        dtype = "fp8_e5m2" if "e5m2" in cache_dtype else "fp8_e4m3"
        views = [v.view(torch.uint8) if v.element_size() == 1 else v for v in views]
    elif cache_dtype != "auto":
        dtype = cache_dtype
    try:
        if mla:
            lay = vllm_paged_layout(views, head_size=int(views[0].shape[-1]), mla=True, dtype=dtype)
        else:
            hd = int(first.head_size)
            lay = vllm_paged_layout(views, head_size=hd, head_size_v=int(getattr(first, "head_size_v", hd)),
                                    total_heads=total, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
    except LayoutError as e:
        raise LayoutError(f"vLLM {backend} cache ({cache_dtype}): {e}") from None
    if lay.dtype not in SCALED_DTYPES:
        return lay
    scales = np.ones((lay.num_layers, lay.kv_factor, lay.num_heads))
    for i, n in enumerate(names):
        for k, attr in enumerate(("_k_scale", "_v_scale")[:lay.kv_factor]):
            s = torch.as_tensor(getattr(layers[n], attr, 1.0)).float().reshape(-1).cpu().numpy()
            if s.size not in (1, lay.num_heads):
                raise LayoutError(f"vLLM layer {n!r}: {s.size} {attr} values for {lay.num_heads} KV head(s)")
            scales[i, k] = s
    return lay.with_scales(scales)


@dataclass
class _Room:
    req: str
    room: int
    kind: str  # "load" | "send"
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    reason: str = ""
    started: bool = False
    cancelled: bool = False  # its request ended before the load could start
    blocks: tuple[int, ...] = ()  # the request's block ids the room reads (send) or fills (load), token order


def _bounded(d: OrderedDict, key: str, value: Any) -> None:
    d[key] = value
    while len(d) > _KEEP:
        d.popitem(last=False)


def _append_record(path: str, line: dict) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")
    except OSError as e:
        log.warning("kvbridge vLLM: cannot append to records_path %s: %s", path, e)


class KVBridgeWorker:
    """One worker's half of the connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, cfg: VllmBridgeConfig):
        self.vllm_config = vllm_config
        self.cfg = cfg
        self._record_keyring = cfg.keyring()  # bootstrap records sealed (kvbridge.common.bootstrap)
        ktc = vllm_config.kv_transfer_config
        self.producer, self.consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self.layout: KVLayout | None = None
        self.rank_side: BridgeRank | None = None  # the transport, sender and receiver (register_kv_caches)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.bootstrap: BootstrapServer | None = None
        self.tp_rank, self.tp_size = 0, 1
        self._lock = threading.RLock()
        self._loads: dict[str, _Room] = {}
        self._sends: dict[str, _Room] = {}
        self._announced: set[str] = set()  # finished requests vLLM told this worker about
        self._forget: set[int] = set()
        self._discovered: dict[str, list[RankRecord]] = {}  # bootstrap address -> its ranks' records
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvbridge-vllm-load")
        self.finished_loads: OrderedDict[str, dict] = OrderedDict()  # request -> how its load ended
        self.finished_sends: OrderedDict[str, dict] = OrderedDict()  # request -> how its send ended

    # -- set-up -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the cache, register it with Mooncake, start the sender / receiver and
        (prefill, TP rank 0) the bootstrap server."""
        if self.layout is not None:
            raise RuntimeError("register_kv_caches called twice")
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            self.tp_rank, self.tp_size = int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
        except (AssertionError, ImportError, RuntimeError):  # no model-parallel group (a bare test harness)
            self.tp_rank, self.tp_size = 0, 1
        self.layout = layout_from_vllm(kv_caches, self.vllm_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        cfg = self.cfg
        self.rank_side = BridgeRank(cfg, "vllm")
        if self.producer:
            self.sender = self.rank_side.start_sender(self.layout)
        if self.consumer:
            self.receiver = self.rank_side.start_receiver(self.layout)
        lay = self.layout
        log.info("kvbridge vLLM worker rank %d/%d: %s, %d layers, %d blocks x %d tokens, %d KV head(s) of %d x %s%s",
                 self.tp_rank, self.tp_size, lay.engine, lay.num_layers, lay.num_blocks, lay.tokens_per_block,
                 lay.num_heads, lay.head_dim, lay.dtype, f"; sender {self.sender.endpoint}" if self.sender else "")
        if self.sender is not None and cfg.bootstrap_port >= 0:
            self._register_rank()

    def _register_rank(self) -> None:
        record = self.rank_side.record()
        if self.tp_rank == 0:
            self.bootstrap = BootstrapServer(self.cfg.host, self.cfg.bootstrap_port, page_size=self.cfg.sglang_page_size,
                                             tp_size=self.tp_size, keyring=self._record_keyring,
                                             allow_insecure=self.cfg.allow_insecure)
            self.bootstrap.register(0, record)
            log.info("kvbridge vLLM: bootstrap server at %s", self.bootstrap.address)
            return
        url = f"http://{self.cfg.host}:{self.cfg.bootstrap_port}/route"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        end = time.monotonic() + self.cfg.discovery_timeout_s
        while True:  # rank 0 may not be up yet
            # sealed afresh each try (a seal lives replay_window_s and is taken once)
            body = json.dumps(seal_record({"attn_tp_rank": self.tp_rank, "kvbridge": msgspec.to_builtins(record)},
                                                self._record_keyring)).encode()
            try:
                with opener.open(urllib.request.Request(url, data=body, method="PUT"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError as e:
                if time.monotonic() > end:
                    raise ConfigError(f"rank {self.tp_rank} cannot register with the bootstrap server {url}: {e}") from e
            time.sleep(0.2)

    # -- every step -------------------------------------------------------------------------
    def start_load_kv(self, meta: Any) -> None:
        """Apply this step's orders (transfers run on kvbridge's threads)."""
        if not isinstance(meta, KVBridgeMetadata):
            return
        for o in meta.orders:
            try:
                {Open: self._open, Send: self._send, Load: self._load, Drop: self._drop}[type(o)](o)
            except Exception:
                log.exception("kvbridge vLLM worker rank %d: %s order for request %s failed", self.tp_rank,
                              type(o).__name__, o.req)

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): sends whose room ended
        (only of requests vLLM said finished), loads whose blocks no sender can still write."""
        with self._lock:
            self._announced.update(finished_req_ids or ())
            sent = {r for r, s in self._sends.items() if s.released.is_set() and r in self._announced}
            for r in sent:
                s = self._sends.pop(r)
                self._announced.discard(r)
                rec = self.sender.record(s.room) if s.started else None
                done = {"room": s.room, "ok": s.ok, "blocks": list(s.blocks), "record": rec.as_dict() if rec else None}
                _bounded(self.finished_sends, r, done)
                if self.cfg.records_path:
                    _append_record(self.cfg.records_path, {"req": r, "side": "send", "rank": self.tp_rank, **done})
                self._forget.add(s.room)
            for room in list(self._forget):
                self.sender.forget(room)
                if self.sender.record(room) is None:
                    self._forget.discard(room)
            loaded, failed = set(), set()
            for r, ld in list(self._loads.items()):
                if not ld.released.is_set():
                    continue
                del self._loads[r]
                loaded.add(r)
                if not ld.ok:
                    failed.add(r)
                done = {"room": ld.room, "ok": ld.ok, "reason": ld.reason, "blocks": list(ld.blocks)}
                if ld.started:
                    rec = self.receiver.record(ld.room)
                    done.update(aux=self.receiver.aux(ld.room), record=rec.as_dict() if rec else None)
                    self.receiver.forget(ld.room)
                _bounded(self.finished_loads, r, done)
                if self.cfg.records_path:
                    _append_record(self.cfg.records_path, {"req": r, "side": "load", "rank": self.tp_rank, **done})
                if ld.ok:
                    log.info("kvbridge vLLM: request %s: room %s loaded", r, ld.room)
                else:
                    log.warning("kvbridge vLLM: request %s: load of room %s failed: %s", r, ld.room, ld.reason)
        return sent, loaded, failed

    # -- orders -----------------------------------------------------------------------------
    def _open(self, o: Open | Send) -> None:
        if o.req in self._sends or self.sender is None:
            return
        s = self._sends[o.req] = _Room(o.req, o.room, "send")

        def release(_blocks, ok, s=s):
            s.ok = ok
            s.released.set()

        try:
            self.sender.forget(o.room)  # a finished room of the same id from an earlier request
            self.sender.add_room(o.room, (), release)
            s.started = True
        except ValueError as e:  # the room is open here already: a router error
            log.error("kvbridge vLLM worker rank %d: request %s: %s", self.tp_rank, o.req, e)
            s.released.set()

    def _send(self, o: Send) -> None:
        self._open(o)
        s = self._sends[o.req]
        if not s.started:
            return
        s.blocks = tuple(o.blocks)
        aux = {"output_ids": [o.first_token]} if o.first_token >= 0 else None
        self.sender.send_chunk(o.room, np.asarray(o.blocks, dtype=np.int64), 0, o.stop, last=True, aux=aux)

    def _drop(self, o: Drop) -> None:
        """A prefill half that ended before its send: vLLM freed its blocks itself (it was
        never reported as held), so it is aborted and never reported. A decode half
        aborted while loading: vLLM holds its blocks until the load is reported, which
        happens once no sender can still write into them."""
        with self._lock:
            s = self._sends.pop(o.req, None)
        if s is not None and s.started:
            self.sender.abort(s.room, o.reason)
            self._forget.add(s.room)
        ld = self._loads.get(o.req)
        if ld is not None:
            ld.cancelled = True
            if ld.started:
                self.receiver.abort(ld.room, o.reason)

    def _load(self, o: Load) -> None:
        if self.receiver is None:
            raise ConfigError("a load order on a worker without a receiver (kv_role kv_producer)")
        ld = self._loads[o.req] = _Room(o.req, o.room, "load", blocks=tuple(o.blocks))
        if o.endpoints:
            self._request(ld, o, list(o.endpoints), None)
        else:
            self._pool.submit(self._discover_then_request, ld, o)

    def _discover_then_request(self, ld: _Room, o: Load) -> None:
        try:
            records = self._discovered.get(o.bootstrap)
            if records is None:
                body = fetch_ranks(o.bootstrap, self.cfg.discovery_timeout_s, keyring=self._record_keyring)
                records = rank_records(body, o.bootstrap)  # checks the topology and each record
                self._discovered[o.bootstrap] = records
            self._request(ld, o, [r.endpoint for r in records], records)
        except (BootstrapError, ValueError, KeyError, TypeError) as e:
            self._discovered.pop(o.bootstrap, None)
            self._fail(ld, f"cannot find the prefill at {o.bootstrap}: {e}")
        except Exception as e:  # on a pool thread nobody waits on: a load must end, whatever went wrong
            log.exception("kvbridge vLLM worker rank %d: discovery at %s crashed", self.tp_rank, o.bootstrap)
            self._discovered.pop(o.bootstrap, None)
            self._fail(ld, f"cannot find the prefill at {o.bootstrap}: internal error: {e!r}")

    def _request(self, ld: _Room, o: Load, endpoints: list[str], records: list[RankRecord] | None) -> None:
        if ld.cancelled:
            return self._fail(ld, "the request ended before its load started")
        lay = self.layout
        eps, receivers = endpoints, 1
        if records:  # the prefill ranks holding heads of this rank, and how many decode ranks pull each
            mine = set(lay.heads)
            eps = []
            for r in records:
                if mine.intersection(r.layout.heads):
                    eps.append(r.endpoint)
            if not eps:
                return self._fail(ld, f"no prefill rank holds KV heads {sorted(mine)}")
            if lay.kv_factor == 1:  # MLA: every rank holds the whole latent; one of them serves this rank
                eps = [eps[self.tp_rank % len(eps)]]
            src_tp = len(records)
            receivers = max(1, self.tp_size // src_tp) if self.tp_size > src_tp else 1
        else:
            src_tp = len(endpoints)
            if self.tp_size > 1 or src_tp > 1:  # without layouts: rank i of n pulls from the ranks with its heads
                first, count = tp_head_slice(lay.total_heads, self.tp_size, self.tp_rank)
                per = max(1, lay.total_heads // src_tp)
                eps = sorted({endpoints[min(src_tp - 1, h // per)] for h in range(first, first + count)},
                             key=endpoints.index)
                receivers = max(1, self.tp_size // src_tp) if self.tp_size > src_tp else 1

        def release(_blocks, ok, ld=ld):
            ld.ok = ok
            ld.reason = "" if ok else self.receiver.failure_reason(ld.room)
            ld.released.set()

        try:
            self.receiver.forget(o.room)
            self.receiver.request(o.room, eps, np.asarray(o.blocks, dtype=np.int64), o.start, o.stop, release,
                                  receivers=receivers)
            ld.started = True
        except (ValueError, LayoutError) as e:
            self._fail(ld, f"{type(e).__name__}: {e}")
            return
        if ld.cancelled:  # a Drop that came between the check above and ``started`` did not abort the room
            self.receiver.abort(o.room, "decode request aborted while loading")

    def _fail(self, ld: _Room, reason: str) -> None:
        log.warning("kvbridge vLLM worker rank %d: request %s: room %s: %s", self.tp_rank, ld.req, ld.room, reason)
        ld.ok, ld.reason = False, reason
        ld.released.set()

    def close(self) -> None:
        """Stop the bootstrap server, sender, receiver and transport."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.bootstrap is not None:
            try:
                self.bootstrap.close()
            except Exception:  # pragma: no cover - best effort at shutdown
                log.exception("kvbridge vLLM: closing the bootstrap server")
        if self.rank_side is not None:
            self.rank_side.close()
