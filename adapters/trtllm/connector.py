"""TensorRT-LLM KV cache connector over kvbridge (``kv_connector_config``).

Enable it on a TensorRT-LLM server with::

    kv_connector_config:
      connector_module: kvbridge.adapters.trtllm
      connector_scheduler_class: KVBridgeConnectorScheduler
      connector_worker_class: KVBridgeConnectorWorker

Interfaces followed (TensorRT-LLM commit 00fdcbff, 1.2 era): in
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` the ABCs ``KvCacheConnectorWorker``
(l. 84; ``register_kv_caches`` l. 113, ``start_load_kv`` l. 123, ``get_finished`` l. 158)
and ``KvCacheConnectorScheduler`` (l. 177; ``build_connector_meta`` l. 184,
``get_num_new_matched_tokens`` l. 196, ``request_finished`` l. 213,
``update_state_after_alloc`` l. 227), and ``KvCacheConnectorManager``, which calls them;
and the executor loop in ``py_executor.py`` (methods named below). Per executor
iteration on every rank, in this order:

1. ``_prepare_and_schedule_batch`` -> ``_prepare_disagg_gen_init`` -> KV cache manager
   ``prepare_resources`` -> C++ ``addSequence``: ``get_num_new_matched_tokens(request,
   num_computed_tokens)`` on rank 0, its result broadcast (manager l. 409, ``_run_on_leader``
   l. 398; async loads parked l. 424), ``setPrepopulatedPromptLen``, then
   ``update_state_after_alloc(request, get_cache_indices(request))`` on rank 0 only
   (l. 537); ``mark_ready_requests`` (l. 436) readies the others.
2. only if a batch is scheduled (``if can_queue:``), ``_kv_connector_start_batch``:
   ``build_connector_meta`` on rank 0, broadcast, ``bind_connector_meta`` on every rank
   (``handle_metadata`` l. 458), ``start_load_kv``; around each decoder layer
   ``wait_for_layer_load`` / ``save_kv_layer`` (forward hooks, l. 544 / 548);
   ``wait_for_save`` at the end of the forward (``_kv_connector_wait_for_save``).
3. ``_send_kv_async``: for finished requests ``request_finished(request,
   get_cache_indices(request))`` on rank 0, broadcast (l. 466, 478); True pins the blocks
   (``AsyncTransferManager.start_transfer``).
4. ``_kv_connector_terminate_requests`` (every iteration, batch or not): manager
   ``get_finished`` (l. 487) calls the worker's ``get_finished(new saving ids, new
   loading ids)`` on every rank, ``mpi_allgather`` (l. 517), and only ids every rank
   reported count: loaded requests go to CONTEXT_INIT (l. 531), saved ones are unpinned
   (``end_transfer``).

Because step 2 does not run while nothing is schedulable (an idle decode server whose
only request is loading; an idle prefill server whose last request is saving), the
scheduler also sends its orders to the workers over its own *bus* (a ZMQ channel on
rank 0, ``BridgeConfig.bus_port``); the connector metadata carries the same orders, and
a worker applies each order once, from whichever arrives first. The bus also carries
the workers' per-request results back to rank 0, which decides for every rank at once
whether a failed load is recomputed or failed, so all ranks treat the request alike.

Decode direction (a request whose handle has ``op: recv``): the scheduler reports the
prompt's first ``prompt_len - 1`` tokens (less the on-device prefix hit) as loadable
asynchronously; on ``update_state_after_alloc`` it orders every worker to pull the room
into the allocated blocks (``KVReceiver.request``, tokens ``[num_computed, prompt_len)``:
the last prompt token's KV is written too, and recomputed by the engine); each worker
reports the request loaded once rank 0's verdict is in. On failure the verdict is
``recompute`` (each rank rewinds the request's ``context_current_position`` to the
on-device prefix, so the engine computes the prompt itself) or ``fail`` (the same
rewind, and rank 0 cancels the request through the executor's ``cancel_request``; it
ends with finish reason CANCELLED). A worker reaches its rank's request objects through
the executor that called ``register_kv_caches`` (``PyExecutor.active_requests``).

Finding the prefill (decode direction): a handle names the prefill's ranks directly
(``endpoints``), its rank-0 bus (``prefill``: asked over the bus), or an SGLang bootstrap
address (``bootstrap``: an SGLang prefill server on the kvbridge backend, or a
TensorRT-LLM prefill with ``sglang_bootstrap_port``); the scheduler then reads the ranks
from ``GET /kvbridge/ranks`` on a background thread (``kvbridge.common.bootstrap``),
waiting at most ``discovery_timeout_s``, and parks the request's load order until then.
A prefill that cannot be found fails the load with a reason naming it (then
``on_failure`` applies). With ``sglang_bootstrap_port`` set, rank 0 runs an
SGLang-compatible bootstrap server registering every rank, so SGLang decode servers
find this server as a prefill.

Prefill direction (``op: send``; the request should have ``max_tokens=1``): on
``update_state_after_alloc`` every worker opens the room on the request's blocks (so
decode ranks that ask early are accepted); ``request_finished`` returns True, holding the
blocks, and orders every worker to send the prompt's KV (``KVSender.send_chunk(...,
last=True, aux={"output_ids": [first_token]})``, the first token being the one the
sampler appended, ``request.get_tokens(0)[prompt_len]``); each worker reports the request
saved once its sender released the blocks (delivered or given up).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import msgspec
import numpy as np
import torch

from kvbridge.common.bootstrap import BootstrapError, endpoints_by_tp_rank, fetch_ranks, rank_record
from kvbridge.common.control import ControlChannel
from kvbridge.common.handoff import KVReceiver, KVSender, default_metrics

from ._compat import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from .config import BridgeConfig, ConfigError
from .geometry import _get, geometry_from_llm_args, pool_layout, pull_plan
from .handle import Handle, HandleError, handle_of

__all__ = ["KVBridgeConnectorScheduler", "KVBridgeConnectorWorker", "KVBridgeConnectorMetadata"]

log = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict)


def _decode_bus(who: str, peer: str, payload: bytes) -> dict | None:
    """A scheduler/worker bus message, or None (logged) when it does not decode."""
    try:
        return _dec.decode(payload)
    except msgspec.DecodeError as e:
        log.warning("kvbridge %s: bad bus message from %s: %s", who, peer, e)
        return None


_LOG_KEEP = 4096  # orders kept for replay to a (re)joining worker

# Rank 0 runs the scheduler and a worker in one process; the worker finds the bus there.
_LOCAL_SCHEDULERS: list["KVBridgeConnectorScheduler"] = []


@dataclass
class KVBridgeConnectorMetadata:
    """What ``build_connector_meta`` hands every worker: the orders issued since the last
    call (each also sent over the bus; workers apply each ``seq`` once)."""

    orders: list[dict] = field(default_factory=list)


def _world_size(llm_args: Any, cfg: BridgeConfig) -> int:
    if cfg.world_size:
        return cfg.world_size
    ws = _get(llm_args, "parallel_config.world_size", 0)
    if ws:
        return int(ws)
    tp = int(_get(llm_args, "tensor_parallel_size", 1) or 1)
    pp = int(_get(llm_args, "pipeline_parallel_size", 1) or 1)
    return tp * pp


@dataclass
class _Load:
    order: dict
    results: dict[int, tuple[bool, str]] = field(default_factory=dict)
    verdict: str = ""
    since: float = field(default_factory=time.monotonic)


class KVBridgeConnectorScheduler(KvCacheConnectorScheduler):
    """Rank 0's half of the connector: decides which requests move KV, orders the
    workers, and hosts the server's bus (rank coordination and endpoint discovery)."""

    def __init__(self, llm_args: Any, *, config: BridgeConfig | None = None):
        super().__init__(llm_args)
        self.cfg = config or BridgeConfig.load()
        self.world_size = _world_size(llm_args, self.cfg)
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._unsent_meta: list[dict] = []
        self._log: OrderedDict[int, dict] = OrderedDict()
        self._workers: dict[int, str] = {}  # rank -> bus identity
        self._endpoints: dict[int, str] = {}  # rank -> KVSender control endpoint
        self._matched: dict[int, tuple[Handle, int, int]] = {}  # request id -> (handle, start, prompt_len)
        self._loads: dict[int, _Load] = {}
        self._who_waiting: list[str] = []  # peers asking for our endpoints before every rank joined
        self._discovered: dict[str, list[str]] = {}  # prefill bus -> its ranks' endpoints
        self._discovering: dict[str, float] = {}  # prefill bus -> when we asked
        self._parked: dict[str, list[int]] = {}  # prefill bus -> request ids waiting for discovery
        self._parked_declines: dict[str, list[dict]] = {}  # prefill bus -> decline orders waiting for discovery
        self.gate = self.cfg.cost_gate(_get(llm_args, "model", None))
        self.fallbacks: OrderedDict[int, dict] = OrderedDict()  # request id -> why it is computed here
        self.bus = ControlChannel(self._on_bus, self._on_tick, bind_host=self.cfg.host, port=self.cfg.bus_port,
                                  name="kvbridge-trtllm-scheduler")
        self.bootstrap = None  # an SGLang-compatible bootstrap server (sglang_bootstrap_port)
        if self.cfg.sglang_bootstrap_port >= 0:
            from kvbridge.common.bootstrap import BootstrapServer

            try:
                self.bootstrap = BootstrapServer(self.cfg.host, self.cfg.sglang_bootstrap_port,
                                                 page_size=self.cfg.sglang_page_size, tp_size=self.world_size)
            except BaseException:
                self.bus.close()
                raise
        self._closed = False
        _LOCAL_SCHEDULERS.append(self)
        log.info("kvbridge scheduler: bus at %s for %d rank(s)%s", self.bus.endpoint, self.world_size,
                 f", SGLang bootstrap at {self.bootstrap.address}" if self.bootstrap else "")

    @property
    def endpoint(self) -> str:
        """This server's bus: where its workers join and decode servers discover its ranks."""
        return self.bus.endpoint

    @property
    def bootstrap_address(self) -> str:
        """``host:port`` of this server's SGLang-compatible bootstrap server ("" when off):
        SGLang requests name it as ``bootstrap_host`` / ``bootstrap_port``."""
        return self.bootstrap.address if self.bootstrap is not None else ""

    # -- KvCacheConnectorScheduler --------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBridgeConnectorMetadata:
        """The orders issued since the last call (the workers apply each one once)."""
        with self._lock:
            orders, self._unsent_meta = self._unsent_meta, []
        return KVBridgeConnectorMetadata(orders)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """For a decode-half request: the prompt tokens past the on-device prefix, all but
        the last, loaded asynchronously. Other requests: (0, False)."""
        try:
            h = handle_of(request)
        except HandleError as e:
            log.error("kvbridge: request %s: %s; computing it locally", request.request_id, e)
            return 0, False
        if h is None or h.op != "recv":
            return 0, False
        prompt_len = int(request.prompt_len)
        n = prompt_len - 1 - int(num_computed_tokens)
        if n <= 0:
            return 0, False
        if self.gate is not None:
            with self._lock:
                if request.request_id in self.fallbacks:
                    return 0, False
            verdict = self.gate.check(prompt_len, int(num_computed_tokens))
            if not verdict.move:
                self._fall_back(request, h, verdict)
                return 0, False
        with self._lock:
            self._matched[request.request_id] = (h, int(num_computed_tokens), prompt_len)
        return n, True

    def _fall_back(self, request: Any, h: Handle, verdict: Any) -> None:
        """Below break-even: the executor computes the prompt here (no external tokens);
        the prefill's room is declined so its blocks come back at once."""
        req = int(request.request_id)
        log.info("kvbridge: request %s (room %s) computed on this server: %s", req, h.room, verdict.reason)
        order = {"op": "decline", "req": req, "room": h.room, "endpoints": list(h.endpoints), "reason": verdict.reason,
                 "label": verdict.label}
        with self._lock:
            self.fallbacks[req] = {"room": h.room, "reason": verdict.reason, "label": verdict.label,
                                   "prompt_len": verdict.prompt_len, "held": verdict.held_tokens}
            while len(self.fallbacks) > _LOG_KEEP:
                self.fallbacks.popitem(last=False)
            if order["endpoints"]:
                self._issue(order)
                return
            key = h.prefill or h.bootstrap
            eps = self._discovered.get(key)
            if eps:
                self._issue(dict(order, endpoints=eps))
                return
            self._parked_declines.setdefault(key, []).append(order)
            first = key not in self._discovering
            self._discovering.setdefault(key, time.monotonic())
        if first:
            self._discover(h)

    def update_state_after_alloc(self, request: Any, block_ids: List[int]):
        """Decode half: order every worker to pull the request's room into ``block_ids``
        (the request's blocks in token order). Prefill half: order every worker to open the
        room on these blocks now, so decode ranks that ask early are accepted at once."""
        with self._lock:
            m = self._matched.pop(request.request_id, None)
        if m is None:
            try:
                h = handle_of(request)
            except HandleError:
                return
            if h is not None and h.op == "send":
                with self._lock:
                    self._issue({"op": "open", "req": int(request.request_id), "room": h.room,
                                 "blocks": [int(b) for b in block_ids]})
            return
        h, start, prompt_len = m
        order = {"op": "load", "req": int(request.request_id), "room": h.room, "blocks": [int(b) for b in block_ids],
                 "start": start, "stop": prompt_len, "endpoints": list(h.endpoints),
                 "on_failure": h.on_failure or self.cfg.on_failure}
        with self._lock:
            self._loads[order["req"]] = _Load(order)
            if order["endpoints"]:
                self._issue(order)
                return
            key = h.prefill or h.bootstrap  # a tcp:// bus, or an SGLang bootstrap host:port
            eps = self._discovered.get(key)
            if eps:
                self._issue(dict(order, endpoints=eps))
                return
            self._parked.setdefault(key, []).append(order["req"])
            first = key not in self._discovering
            self._discovering.setdefault(key, time.monotonic())
        if first:
            self._discover(h)

    def _discover(self, h: Handle) -> None:
        """Ask for the prefill's ranks: over the bus (``prefill``), or from an SGLang
        bootstrap server on a background thread (``bootstrap``)."""
        if not h.bootstrap or h.prefill:
            self.bus.send(h.prefill, _enc.encode({"t": "who"}))
            return
        threading.Thread(target=self._discover_bootstrap, args=(h.bootstrap,), daemon=True,
                         name="kvbridge-trtllm-discover").start()

    def _discover_bootstrap(self, address: str) -> None:
        try:
            eps = endpoints_by_tp_rank(fetch_ranks(address, self.cfg.discovery_timeout_s), address)
        except (BootstrapError, ValueError) as e:
            with self._lock:
                if not self._closed and self._discovering.pop(address, None) is not None:
                    self._fail_parked(address, str(e))
            return
        with self._lock:
            if not self._closed:
                log.info("kvbridge scheduler: prefill at %s has %d rank(s): %s", address, len(eps), eps)
                self._on_discovered(address, eps)

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        """Prefill-half request: hold its blocks and order every worker to serve its room
        (True). Other requests: False."""
        with self._lock:
            self._loads.pop(request.request_id, None)
            self._matched.pop(request.request_id, None)
        try:
            h = handle_of(request)
        except HandleError as e:
            log.error("kvbridge: request %s: %s", request.request_id, e)
            return False
        if h is None or h.op != "send":
            return False
        prompt_len = int(request.prompt_len)
        if int(getattr(request, "context_remaining_length", 0) or 0) > 0:
            log.warning("kvbridge: room %s: request %s finished before its prefill did; not serving it",
                        h.room, request.request_id)
            with self._lock:
                self._issue({"op": "abort", "req": int(request.request_id), "room": h.room})
            return False
        tokens = list(request.get_tokens(0))
        first = int(tokens[prompt_len]) if len(tokens) > prompt_len else None
        order = {"op": "send", "req": int(request.request_id), "room": h.room,
                 "blocks": [int(b) for b in cache_block_ids], "stop": prompt_len, "first_token": first}
        with self._lock:
            self._issue(order)
        return True

    # -- orders and the bus ---------------------------------------------------------------
    def _issue(self, order: dict) -> None:
        """Number an order, queue it for the next metadata, send it to every worker."""
        order = dict(order, seq=next(self._seq))
        self._unsent_meta.append(order)
        self._log[order["seq"]] = order
        while len(self._log) > _LOG_KEEP:
            self._log.popitem(last=False)
        payload = _enc.encode({"t": "orders", "orders": [order]})
        for ident in self._workers.values():
            self.bus.send(ident, payload)

    def _on_bus(self, peer: str, payload: bytes) -> None:
        msg = _decode_bus("scheduler", peer, payload)
        if msg is None:
            return
        t = msg.get("t")
        with self._lock:
            if t == "hello":
                rank = int(msg["rank"])
                self._workers[rank], self._endpoints[rank] = peer, str(msg["endpoint"])
                if self.bootstrap is not None and isinstance(msg.get("record"), dict):
                    self.bootstrap.register(rank, msg["record"])
                log.info("kvbridge scheduler: rank %d joined (sender %s)", rank, msg["endpoint"])
                if self._log:
                    self.bus.send(peer, _enc.encode({"t": "orders", "orders": list(self._log.values())}))
                self._answer_who()
            elif t == "who":
                self._who_waiting.append(peer)
                self._answer_who()
            elif t == "endpoints":
                self._on_discovered(peer, [str(e) for e in msg.get("endpoints", [])])
            elif t == "result":
                self._on_result(int(msg["req"]), int(msg["rank"]), bool(msg["ok"]), str(msg.get("reason", "")))
            else:
                log.warning("kvbridge scheduler: unknown bus message %r from %s", t, peer)

    def _answer_who(self) -> None:
        if len(self._endpoints) < self.world_size or not self._who_waiting:
            return
        payload = _enc.encode({"t": "endpoints", "endpoints": [self._endpoints[r] for r in range(self.world_size)]})
        for peer in self._who_waiting:
            self.bus.send(peer, payload)
        self._who_waiting.clear()

    def _on_discovered(self, prefill: str, eps: list[str]) -> None:
        self._discovering.pop(prefill, None)
        if not eps:
            self._fail_parked(prefill, "prefill server reported no ranks")
            return
        self._discovered[prefill] = eps
        for order in self._parked_declines.pop(prefill, []):
            self._issue(dict(order, endpoints=eps))
        for req in self._parked.pop(prefill, []):
            load = self._loads.get(req)
            if load is not None:
                load.order = dict(load.order, endpoints=eps)
                self._issue(load.order)

    def _fail_parked(self, prefill: str, reason: str) -> None:
        for order in self._parked_declines.pop(prefill, []):  # its room ends at the prefill's deadline
            log.warning("kvbridge: room %s: cannot tell prefill %s it was declined: %s", order["room"], prefill, reason)
        for req in self._parked.pop(prefill, []):
            load = self._loads.get(req)
            if load is not None:
                log.warning("kvbridge: request %s: cannot reach prefill %s: %s", req, prefill, reason)
                self._decide(req, load, ok=False, reason=f"cannot reach prefill {prefill}: {reason}")

    def _on_result(self, req: int, rank: int, ok: bool, reason: str) -> None:
        load = self._loads.get(req)
        if load is None or load.verdict:
            return
        load.results[rank] = (ok, reason)
        if not ok:
            log.warning("kvbridge: request %s (room %s): rank %d failed: %s", req, load.order["room"], rank, reason)
        if len(load.results) >= self.world_size:
            self._decide(req, load, all(r[0] for r in load.results.values()))

    def _decide(self, req: int, load: _Load, ok: bool, reason: str = "") -> None:
        load.verdict = "ok" if ok else load.order["on_failure"]
        if load.verdict == "recompute":
            default_metrics().fallbacks.labels("receiver", "handoff_failed").inc()
        self._issue({"op": "verdict", "req": req, "action": load.verdict, "start": load.order["start"],
                     "reason": reason[:2000]})

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            for prefill, t0 in list(self._discovering.items()):
                # a bus answers at once; a bootstrap server's thread has its own deadline (this is a backstop)
                limit = self.cfg.peer_timeout_s if prefill.startswith("tcp://") else self.cfg.discovery_timeout_s + 5.0
                if now - t0 > limit:
                    self._discovering.pop(prefill, None)
                    self._fail_parked(prefill, f"no answer within {self.cfg.peer_timeout_s:.1f} s")

    def close(self) -> None:
        """Stop the bus."""
        if self in _LOCAL_SCHEDULERS:
            _LOCAL_SCHEDULERS.remove(self)
        with self._lock:
            self._closed = True
        if self.bootstrap is not None:
            self.bootstrap.close()
        self.bus.close()


@dataclass
class _LoadRoom:
    req: int
    room: int
    start: int
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    reason: str = ""
    verdict: str = ""
    cancelled: bool = False
    started: bool = False


@dataclass
class _SendRoom:
    req: int
    room: int
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    opened: bool = False


def _find_executor() -> Any:
    """The PyExecutor registering the pool (``PyExecutor._maybe_init_kv_connector_manager``
    calls ``register_kv_caches``): what a failed load needs to rewind or cancel its request."""
    frame = inspect.currentframe()
    try:
        f = frame.f_back.f_back if frame and frame.f_back else None
        for _ in range(6):
            if f is None:
                break
            obj = f.f_locals.get("self")
            if obj is not None and hasattr(obj, "active_requests") and hasattr(obj, "kv_connector_manager"):
                return obj
            f = f.f_back
    finally:
        del frame
    return None


class KVBridgeConnectorWorker(KvCacheConnectorWorker):
    """Every rank's half of the connector: owns the rank's pool registration, transport,
    sender and receiver, applies the scheduler's orders, and reports finished handoffs."""

    def __init__(self, llm_args: Any, *, config: BridgeConfig | None = None):
        super().__init__(llm_args)
        self.cfg = config or BridgeConfig.load()
        self.layout = None
        self.transport = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.bus: ControlChannel | None = None
        self.rank = 0
        self.tp_size = 1
        self._scheduler_ep = ""
        self._executor: Any = None
        self._lock = threading.RLock()
        self._seen: set[int] = set()
        self._seen_floor = 0
        self._loads: dict[int, _LoadRoom] = {}
        self._sends: dict[int, _SendRoom] = {}
        self._announced_loading: set[int] = set()
        self._announced_saving: set[int] = set()
        self._forget_sent: set[int] = set()
        self.finished_loads: OrderedDict[int, dict] = OrderedDict()  # request id -> how its load ended
        self.finished_saves: OrderedDict[int, dict] = OrderedDict()  # request id -> how its send ended (+ record)
        self.declined: OrderedDict[int, dict] = OrderedDict()  # request id -> record of its declined room (rank 0)

    # -- KvCacheConnectorWorker -----------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor):
        """Describe and register this rank's primary pool, start its sender and receiver,
        and join rank 0's bus."""
        from kvbridge.common.transport import MooncakeTransport

        if self.layout is not None:
            raise RuntimeError("register_kv_caches called twice")
        self._executor = _find_executor()
        if self._executor is None:
            log.warning("kvbridge worker: no executor found; failed loads cannot fall back to recompute")
        geo = geometry_from_llm_args(self._llm_args, self.cfg)
        self.rank, self.tp_size = geo.tp_rank, geo.tp_size
        self.layout = pool_layout(kv_cache_tensor, geo)
        cfg = self.cfg
        self.transport = MooncakeTransport(cfg.host, cfg.metadata_server, cfg.protocol, cfg.device_name)
        hc = cfg.handoff()
        self.sender = KVSender(self.layout, self.transport, host=cfg.host, config=hc)
        self.receiver = KVReceiver(self.layout, self.transport, config=hc)
        log.info("kvbridge worker rank %d/%d: %s pool, %d blocks x %d tokens, %d KV head(s) of %d x %s; sender %s",
                 self.rank, self.tp_size, self.layout.engine, self.layout.num_blocks, self.layout.tokens_per_block,
                 self.layout.num_heads, self.layout.head_dim, self.layout.dtype, self.sender.endpoint)
        self._scheduler_ep = self._find_scheduler(_world_size(self._llm_args, cfg))
        self.bus = ControlChannel(self._on_bus, None, name=f"kvbridge-trtllm-worker{self.rank}")
        record = rank_record(endpoint=self.sender.endpoint, session=self.transport.session_id, engine="trtllm",
                             page_size=self.layout.tokens_per_block, layout=self.layout.describe())
        self.bus.send(self._scheduler_ep, _enc.encode({"t": "hello", "rank": self.rank, "endpoint": self.sender.endpoint,
                                                      "record": record}))

    def _find_scheduler(self, world: int) -> str:
        local = _LOCAL_SCHEDULERS[-1].endpoint if _LOCAL_SCHEDULERS else ""
        if self.cfg.scheduler_endpoint:
            ep = local if self.cfg.scheduler_endpoint == "local" else self.cfg.scheduler_endpoint
        elif world > 1:
            try:  # pragma: no cover - only under TensorRT-LLM's MPI launch
                from tensorrt_llm._utils import mpi_broadcast

                ep = mpi_broadcast(local or None, root=0)
            except Exception as e:
                raise ConfigError(f"rank {self.rank} cannot learn rank 0's kvbridge bus over MPI ({e}); "
                                  "set scheduler_endpoint (KVBRIDGE_SCHEDULER_ENDPOINT)") from e
        else:
            ep = local
        if not ep:
            raise ConfigError("no kvbridge scheduler in this process and no scheduler_endpoint set")
        return ep

    def start_load_kv(self, stream: torch.cuda.Stream):
        """Apply the orders in this step's metadata that the bus has not delivered yet
        (the transfers themselves run in the background)."""
        meta = self.get_connector_meta()
        if isinstance(meta, KVBridgeConnectorMetadata):
            self._apply(meta.orders)

    def wait_for_layer_load(self, layer_idx: int, stream: torch.cuda.Stream):
        """Nothing to wait for: a loading request is not scheduled until every layer landed."""

    def save_kv_layer(self, layer_idx: int, stream: torch.cuda.Stream):
        """Nothing per layer: a prompt's KV is sent once the request finished its prefill."""

    def wait_for_save(self, stream: torch.cuda.Stream):
        """Nothing to wait for: sends are asynchronous and their blocks stay held until
        ``get_finished`` reports them."""

    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """(saved, loaded): prefill-half requests whose blocks the sender released, and
        decode-half requests whose verdict from rank 0 is in (a failed load rewound to be
        recomputed, or cancelled, first). Only ids announced in these arguments are returned."""
        with self._lock:
            self._announced_saving.update(int(i) for i in finished_gen_req_ids)
            self._announced_loading.update(int(i) for i in started_loading_req_ids)
            saved = [r for r, s in self._sends.items() if s.released.is_set() and r in self._announced_saving]
            for r in saved:
                s = self._sends.pop(r)
                rec = self.sender.record(s.room) if s.opened else None
                self.finished_saves[r] = {"room": s.room, "ok": s.ok, "record": rec.as_dict() if rec else None}
                while len(self.finished_saves) > _LOG_KEEP:
                    self.finished_saves.popitem(last=False)
                self._forget_sent.add(s.room)
                self._announced_saving.discard(r)
            for room in list(self._forget_sent):  # a room is forgettable once its last write returned
                self.sender.forget(room)
                if self.sender.record(room) is None:
                    self._forget_sent.discard(room)
            loaded = []
            for r, ld in list(self._loads.items()):
                if r in self._announced_loading and ld.verdict and self._settle_load(ld):
                    loaded.append(r)
                    del self._loads[r]
                    self._announced_loading.discard(r)
                    done = {"room": ld.room, "ok": ld.ok, "reason": ld.reason, "verdict": ld.verdict}
                    if ld.started:
                        rec = self.receiver.record(ld.room)
                        done.update(aux=self.receiver.aux(ld.room), record=rec.as_dict() if rec else None)
                        self.receiver.forget(ld.room)
                    self.finished_loads[r] = done
                    while len(self.finished_loads) > _LOG_KEEP:
                        self.finished_loads.popitem(last=False)
        return saved, loaded

    # -- orders ---------------------------------------------------------------------------
    def _on_bus(self, peer: str, payload: bytes) -> None:
        msg = _decode_bus("worker", peer, payload)
        if msg is None:
            return
        if msg.get("t") == "orders":
            self._apply(msg.get("orders", []))

    def _apply(self, orders: list[dict]) -> None:
        for o in orders:
            with self._lock:
                seq = int(o["seq"])
                if seq <= self._seen_floor or seq in self._seen:
                    continue
                self._seen.add(seq)
                if len(self._seen) > 2 * _LOG_KEEP:
                    self._seen_floor = sorted(self._seen)[-_LOG_KEEP]
                    self._seen = {s for s in self._seen if s > self._seen_floor}
                try:
                    getattr(self, "_order_" + o["op"])(o)
                except Exception:
                    log.exception("kvbridge worker rank %d: order %s failed", self.rank, o.get("op"))

    def _order_load(self, o: dict) -> None:
        req, room = int(o["req"]), int(o["room"])
        ld = self._loads.setdefault(req, _LoadRoom(req, room, int(o["start"])))
        try:
            eps = list(o["endpoints"])
            plan = pull_plan(self.layout.total_heads, len(eps), self.tp_size, self.rank)
            blocks = np.asarray(o["blocks"], dtype=np.int64)

            def release(_blocks, ok, ld=ld):
                ld.ok = ok
                ld.reason = "" if ok else self.receiver.failure_reason(ld.room)
                ld.released.set()
                self._report(ld)

            self.receiver.request(room, [eps[i] for i in plan.ranks], blocks, ld.start, int(o["stop"]), release,
                                  receivers=plan.receivers)
            ld.started = True
        except Exception as e:
            log.warning("kvbridge worker rank %d: request %s: cannot pull room %s: %s", self.rank, req, room, e)
            ld.ok, ld.reason = False, f"{type(e).__name__}: {e}"
            ld.released.set()
            self._report(ld)

    def _report(self, ld: _LoadRoom) -> None:
        self.bus.send(self._scheduler_ep, _enc.encode({"t": "result", "req": ld.req, "rank": self.rank, "ok": ld.ok,
                                                      "reason": ld.reason[:2000]}))

    def _order_verdict(self, o: dict) -> None:
        req = int(o["req"])
        ld = self._loads.setdefault(req, _LoadRoom(req, -1, int(o["start"])))
        ld.verdict = str(o["action"])
        if o.get("reason") and not ld.reason:
            ld.reason = str(o["reason"])

    def _order_decline(self, o: dict) -> None:
        """Below break-even (rank 0 speaks for every rank): tell each prefill rank that this
        room will not be pulled, so it releases the room's blocks."""
        if self.rank != 0:
            return
        rec = self.receiver.decline(int(o["room"]), list(o["endpoints"]), str(o["reason"]),
                                    label=str(o.get("label") or "below_break_even"))
        self.declined[int(o["req"])] = rec.as_dict()
        while len(self.declined) > _LOG_KEEP:
            self.declined.popitem(last=False)

    def _order_open(self, o: dict) -> None:
        req, room = int(o["req"]), int(o["room"])
        if req in self._sends:
            return
        s = self._sends[req] = _SendRoom(req, room)

        def release(_blocks, ok, s=s):
            s.ok = ok
            s.released.set()

        try:
            self.sender.add_room(room, np.asarray(o["blocks"], dtype=np.int64), release)
            s.opened = True
        except ValueError as e:  # the room id is already open here: a router error
            log.error("kvbridge worker rank %d: request %s: %s", self.rank, req, e)
            s.released.set()

    def _order_send(self, o: dict) -> None:
        req, room = int(o["req"]), int(o["room"])
        self._order_open(o)  # no-op when the room was opened at admission
        if not self._sends[req].opened:
            return
        aux = {"output_ids": [int(o["first_token"])]} if o.get("first_token") is not None else None
        self.sender.send_chunk(room, np.asarray(o["blocks"], dtype=np.int64), 0, int(o["stop"]), last=True, aux=aux)

    def _order_abort(self, o: dict) -> None:
        s = self._sends.pop(int(o["req"]), None)
        if s is not None and s.opened:
            self.sender.abort(s.room, "prefill request ended before its prompt was computed")
            self._forget_sent.add(s.room)

    # -- a load's end ---------------------------------------------------------------------
    def _settle_load(self, ld: _LoadRoom) -> bool:
        """Apply the verdict to this rank's copy of the request; True once it may be reported."""
        if ld.started and not ld.released.is_set():
            return False  # a sender may still be writing into the blocks
        if ld.verdict == "ok":
            return True
        if self._executor is None:
            if not ld.cancelled:
                ld.cancelled = True
                log.error("kvbridge worker rank %d: request %s failed to load and cannot fall back (no executor found "
                          "at register_kv_caches); holding it", self.rank, ld.req)
            return False
        req = self._request(ld.req)
        if ld.verdict == "recompute":
            if req is None:  # gone already (cancelled by the client): nothing to rewind
                return True
            req.context_current_position = ld.start
            log.warning("kvbridge worker rank %d: request %s recomputes tokens %d.. after a failed handoff",
                        self.rank, ld.req, ld.start)
            return True
        # "fail": the same rewind (so whatever runs before the cancel lands computes correct
        # KV), and rank 0 cancels the request through the executor's request queue, which
        # delivers the cancel to every rank; it ends with finish reason CANCELLED
        if req is not None:
            req.context_current_position = ld.start
        if self.rank == 0 and hasattr(self._executor, "cancel_request"):
            log.warning("kvbridge: request %s failed to load; cancelling it", ld.req)
            self._executor.cancel_request(ld.req)
        return True

    def _request(self, req_id: int) -> Any:
        for r in getattr(self._executor, "active_requests", None) or ():
            if getattr(r, "request_id", None) == req_id or getattr(r, "py_request_id", None) == req_id:
                return r
        return None

    def close(self) -> None:
        """Stop the bus, sender, receiver and transport."""
        for part in (self.bus, self.receiver, self.sender):
            if part is not None:
                part.close()
        if self.transport is not None:
            self.transport.close()
