"""Rank 0's half of the kvbridge TensorRT-LLM connector (``KVBridgeConnectorScheduler``).

TensorRT-LLM builds it on rank 0 only (``py_executor_creator``: ``scheduler_cls(llm_args)``)
and calls it through its ``KvCacheConnectorManager``, whose answers every rank receives
by MPI broadcast. It decides which requests move KV, orders every rank's worker, and
hosts the server's *bus* (``BridgeConfig.bus_port``): workers join it, other servers ask
it for this server's ranks, routers announce handoffs to it (``handle.announce``).

Which request is which half: a router announces each half under its prompt
(``prompt_key``) before sending it; a decode half is recognised in
``get_num_new_matched_tokens`` from what the C++ request copy exposes
(``get_tokens(0)``, ``prompt_len``), a prefill half in ``update_state_after_alloc``
from the Python request. Orders reach the workers in the connector metadata AND over
the bus: TensorRT-LLM builds metadata only in iterations that schedule a batch, and an
idle server whose only request is loading (or saving) schedules none.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import msgspec

from kvbridge.common.auth import check_bind
from kvbridge.common.bootstrap import BootstrapError, endpoints_by_tp_rank, fetch_ranks
from kvbridge.common.control import ControlChannel
from kvbridge.common.handoff import default_metrics
from kvbridge.common.limits import BoundedMap, LogLimiter

from . import bus as B
from ._compat import KvCacheConnectorScheduler
from .config import BridgeConfig, ConfigError
from .geometry import _get
from .handle import Handle, prompt_key
from .idle import IdleWake
from .refusals import refuse_unsupported

__all__ = ["KVBridgeConnectorMetadata", "KVBridgeConnectorScheduler", "LOCAL_SCHEDULERS"]

log = logging.getLogger(__name__)

_LOG_KEEP = 4096  # orders kept for replay to a (re)joining worker; finished records kept
_MAX_EXPECTED = 1 << 16  # announced handles held at once (then an Expect is refused by name)
_MAX_EXPECTED_PER_KEY = 256  # announced handles for one prompt
_MAX_EXPECT_TTL_S = 3600.0  # an announced handle is held at most this long, whatever ttl_s asked
_MAX_PEERS = 4096  # prefill servers a scheduler keeps the ranks of; bus peers waiting for Endpoints
_MAX_PARKED = 4096  # orders waiting for one prefill's endpoints (past it, or _MAX_PEERS prefills, an order fails)


@dataclass(eq=False)
class _Announced:
    """One announced handle waiting for its request; ``alive`` False once taken or expired
    (the expiry heap drops it lazily)."""

    handle: Handle
    expires: float
    alive: bool = True

# Rank 0 runs the scheduler and a worker in one process; the worker finds the bus here.
LOCAL_SCHEDULERS: list["KVBridgeConnectorScheduler"] = []


@dataclass
class KVBridgeConnectorMetadata:
    """What ``build_connector_meta`` hands every worker: the orders issued since the last
    call (each also sent over the bus; workers apply each ``seq`` once)."""

    orders: list = field(default_factory=list)
    layers: list = field(default_factory=list)  # B.SendLayers for this iteration's forward (layer-wise prefill)


@dataclass
class _Stream:
    """A layer-wise prefill half: its room, prompt, the blocks the engine reported so far
    (token order) and how far its tokens have been handed to a forward."""

    room: int
    prompt_len: int
    blocks: list = field(default_factory=list)
    sent_to: int = -1  # -1: no forward yet (the first one also sends tokens the device cache held)


def world_size(llm_args: Any, cfg: BridgeConfig) -> int:
    """Ranks that run a connector worker (tensor x pipeline parallel size)."""
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
    order: B.Load
    results: dict[int, tuple[bool, str]] = field(default_factory=dict)
    verdict: str = ""


class KVBridgeConnectorScheduler(KvCacheConnectorScheduler):
    """Rank 0's half of the connector: decides which requests move KV, orders the
    workers, and hosts the server's bus (rank coordination, discovery, announcements)."""

    def __init__(self, llm_args: Any, *, config: BridgeConfig | None = None):
        super().__init__(llm_args)
        refuse_unsupported(llm_args)
        self.cfg = config or BridgeConfig.load(llm_args=llm_args)
        self.world_size = world_size(llm_args, self.cfg)
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._unsent_meta: list = []
        self._log: OrderedDict[int, Any] = OrderedDict()
        self._workers: dict[int, str] = {}  # rank -> bus identity
        self._endpoints: dict[int, str] = {}  # rank -> KVSender control endpoint
        self._expected: dict[str, deque] = {}  # prompt key -> its announced handles (_Announced), oldest first
        self._expiry: list[tuple[float, int, str, _Announced]] = []  # heap: (expires, seq, key, entry)
        self._n_expected = 0  # entries still alive
        self._expiry_seq = itertools.count()
        self._expired_log = LogLimiter(log, "kvbridge scheduler: announced handoffs expired")
        self._full_log = LogLimiter(log, "kvbridge scheduler: discovery at its caps")
        self._answers: dict[int, tuple[int, bool]] = {}  # request id -> its matched-token answer
        self._matched: dict[int, tuple[Handle, int, int]] = {}  # request id -> (handle, start, prompt_len)
        self._sending: dict[int, Handle] = {}  # request id -> prefill handle
        self._streams: dict[int, _Stream] = {}  # request id -> its layer-wise send (layerwise on)
        self._loads: dict[int, _Load] = {}
        # bus peers asking Who before every rank joined (-> None, in the order they asked; the oldest dropped past the cap, counted)
        self._who_waiting: dict[str, None] = BoundedMap(_MAX_PEERS, name="trtllm_who_waiting",
                                                        on_evict=default_metrics().evicted)
        # prefill bus / bootstrap -> its ranks' endpoints (the least recently learned dropped past the cap, counted)
        self._discovered: dict[str, list[str]] = BoundedMap(_MAX_PEERS, name="trtllm_discovered", lru=True,
                                                            on_evict=default_metrics().evicted)
        self._discovering: dict[str, float] = {}
        self._parked: dict[str, list] = {}  # prefill -> orders waiting for its endpoints
        self.gate = self.cfg.cost_gate(_get(llm_args, "model", None))
        self.layerwise_chooser = self.cfg.layerwise_chooser(_get(llm_args, "model", None))  # layerwise=auto
        self.layerwise_decisions: OrderedDict[int, bool] = OrderedDict()  # request id -> layer-wise or not (prefill halves)
        self.fallbacks: OrderedDict[int, dict] = OrderedDict()  # request id -> why it is computed here
        self.idle_wake = IdleWake(self.world_size)  # wakes 1.2's idle executor for released blocks (rank 0's worker attaches it)
        self._keyring = self.cfg.keyring()  # every bus message sealed (kvbridge.common.auth)
        self._bad_bus = LogLimiter(log, "kvbridge scheduler: refused bus messages")
        try:
            check_bind(self.cfg.host, self.cfg.secret, self.cfg.allow_insecure, "the kvbridge TensorRT-LLM bus")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.bus = ControlChannel(self._on_bus, self._on_tick, bind_host=self.cfg.host, port=self.cfg.bus_port,
                                  name="kvbridge-trtllm-scheduler")
        self.bootstrap = None  # an SGLang-compatible bootstrap server (sglang_bootstrap_port)
        if self.cfg.sglang_bootstrap_port >= 0:
            from kvbridge.common.bootstrap import BootstrapServer

            try:
                self.bootstrap = BootstrapServer(self.cfg.host, self.cfg.sglang_bootstrap_port,
                                                 page_size=self.cfg.sglang_page_size, tp_size=self.world_size,
                                                 keyring=self._keyring, allow_insecure=self.cfg.allow_insecure)
            except BaseException:
                self.bus.close()
                raise
        self._closed = False
        LOCAL_SCHEDULERS.append(self)
        log.info("kvbridge scheduler: bus at %s for %d rank(s)%s", self.bus.endpoint, self.world_size,
                 f", SGLang bootstrap at {self.bootstrap.address}" if self.bootstrap else "")

    @property
    def endpoint(self) -> str:
        """This server's bus: where its workers join, decode servers discover its ranks
        and routers announce handoffs."""
        return self.bus.endpoint

    @property
    def bootstrap_address(self) -> str:
        """``host:port`` of this server's SGLang-compatible bootstrap server ("" when off)."""
        return self.bootstrap.address if self.bootstrap is not None else ""

    # -- KvCacheConnectorScheduler (TensorRT-LLM calls these on rank 0) ------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        """Called by the connector manager in each iteration that schedules a batch, before
        the forward (rank 0; the result is broadcast): the orders issued since the last call."""
        with self._lock:
            orders, self._unsent_meta = self._unsent_meta, []
            layers = self._layer_orders(scheduler_output) if self._streams else []
        return KVBridgeConnectorMetadata(orders, layers)

    def _layer_orders(self, out: Any) -> list:
        """Layer-wise: a ``SendLayers`` for each open prefill half this forward computes
        tokens of, from the scheduler output's ``RequestData`` (``computed_position``,
        ``num_scheduled_tokens``, the new block ids). A half's first forward also covers the
        tokens before it (device cache hits: their KV is in the pool already). Lock held."""
        orders = []
        for data in list(getattr(out, "new_requests", None) or ()) + list(getattr(out, "cached_requests", None) or ()):
            st = self._streams.get(int(data.request_id))
            if st is None:
                continue
            st.blocks.extend(int(b) for b in data.new_block_ids)
            start = 0 if st.sent_to < 0 else st.sent_to
            stop = min(st.prompt_len, int(data.computed_position) + int(data.num_scheduled_tokens))
            if stop <= start:
                continue
            st.sent_to = stop
            orders.append(B.SendLayers(req=int(data.request_id), room=st.room, blocks=list(st.blocks), start=start,
                                       stop=stop))
        return orders

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Called by C++ ``addSequence`` (block reuse on) for a request's first context
        chunk, with a C++ ``LlmRequest`` copy (only bound names: ``request_id``,
        ``prompt_len``, ``get_tokens``...). A request announced as a decode half: the prompt
        tokens past the device match, all but the last, loaded asynchronously. Otherwise
        ``(0, False)``. The same request asked again gets the same answer."""
        rid = int(request.request_id)
        with self._lock:
            if rid in self._answers:
                return self._answers[rid]
        prompt_len = int(request.prompt_len)
        key = prompt_key(request.get_tokens(0)[:prompt_len])
        h = self._take_expected(key, "recv")
        answer = (0, False)
        if h is not None:
            n = prompt_len - 1 - int(num_computed_tokens)
            if n <= 0:
                self._decline(rid, h, "the decode server holds the whole prompt already", "prefix_hit")
            elif self.gate is not None and not (verdict := self.gate.check(prompt_len, int(num_computed_tokens))).move:
                self._fall_back(rid, h, verdict)
            else:
                with self._lock:
                    self._matched[rid] = (h, int(num_computed_tokens), prompt_len)
                answer = (n, True)
        with self._lock:
            self._answers[rid] = answer
            while len(self._answers) > _LOG_KEEP:
                self._answers.pop(next(iter(self._answers)))
        return answer

    def update_state_after_alloc(self, request: Any, block_ids: List[int]):
        """Called by the KV cache manager's ``prepare_resources`` right after it allocated a
        request's first blocks (rank 0, not broadcast), with the Python ``LlmRequest``.
        Decode half: order every worker to pull the room into ``block_ids``. A request
        announced as a prefill half: order every worker to open its room on these blocks,
        so decode ranks that ask early are accepted at once."""
        rid = int(request.request_id)
        with self._lock:
            self._answers.pop(rid, None)
            m = self._matched.pop(rid, None)
        if m is None:
            key = prompt_key(request.get_tokens(0)[:int(request.prompt_len)])
            h = self._take_expected(key, "send")
            if h is not None:
                layerwise = self._layerwise(rid, h, int(request.prompt_len))
                with self._lock:
                    self._sending[rid] = h
                    if layerwise:
                        self._streams[rid] = _Stream(h.room, int(request.prompt_len))
                    self._issue(B.Open(req=rid, room=h.room, blocks=[int(b) for b in block_ids]))
            return
        h, start, prompt_len = m
        order = B.Load(req=rid, room=h.room, blocks=[int(b) for b in block_ids], start=start, stop=prompt_len,
                       endpoints=list(h.endpoints), on_failure=h.on_failure or self.cfg.on_failure)
        with self._lock:
            self._loads[rid] = _Load(order)
        self._route(order, h)

    def _layerwise(self, rid: int, h: Handle, prompt_len: int) -> bool:
        """Whether prefill half ``rid`` sends layer by layer: the ``layerwise`` setting, or
        with "auto" the cost model's decision for its prompt length."""
        go, why = self.cfg.sends_layerwise(prompt_len, self.layerwise_chooser)  # as the SGLang prefill decides
        log.debug("kvbridge: room %s (request %s): %s", h.room, rid, why)
        with self._lock:
            self.layerwise_decisions[rid] = go
            while len(self.layerwise_decisions) > _LOG_KEEP:
                self.layerwise_decisions.popitem(last=False)
        return go

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        """Called by ``PyExecutor._send_kv_async`` for a finished request (with the overlap
        scheduler, one iteration after it finished), with the Python ``LlmRequest``; the
        answer is broadcast. Prefill half: True (TensorRT-LLM keeps the blocks until every
        worker reports the send done) and every worker sends the prompt's KV, the sampled
        first token riding along. Otherwise False."""
        rid = int(request.request_id)
        with self._lock:
            self._loads.pop(rid, None)
            self._matched.pop(rid, None)
            self._answers.pop(rid, None)
            h = self._sending.pop(rid, None)
            st = self._streams.pop(rid, None)
        if h is None:
            return False
        prompt_len = int(request.prompt_len)
        if int(request.context_remaining_length) > 0:
            log.warning("kvbridge: room %s: request %s finished before its prefill did; not serving it", h.room, rid)
            with self._lock:
                self._issue(B.Drop(req=rid, room=h.room, reason="prefill request ended before its prompt was computed"))
            return False
        tokens = request.get_tokens(0)
        first = int(tokens[prompt_len]) if len(tokens) > prompt_len else -1
        with self._lock:
            self._issue(B.Send(req=rid, room=h.room, blocks=[int(b) for b in cache_block_ids], stop=prompt_len,
                               first_token=first, layered_to=max(st.sent_to, 0) if st is not None else 0))
        return True

    # -- announced handles -----------------------------------------------------------------
    def _take_expected(self, key: str, op: str) -> Handle | None:
        now = time.monotonic()
        with self._lock:
            for e in self._expected.get(key, ()):
                if e.alive and e.expires >= now and e.handle.op == op:
                    e.alive = False
                    self._n_expected -= 1
                    self._compact(key)
                    return e.handle
        return None

    def _compact(self, key: str) -> None:
        """Drop the dead entries at the front of ``key``'s queue, and the key once it is empty (lock held)."""
        q = self._expected.get(key)
        while q and not q[0].alive:
            q.popleft()
        if q is not None and not q:
            del self._expected[key]

    def _expire(self, now: float) -> None:
        """Announced handles past their TTL, in expiry order: O(log n) each (lock held)."""
        while self._expiry and self._expiry[0][0] < now:
            _, _, key, e = heapq.heappop(self._expiry)
            if e.alive:
                e.alive = False
                self._n_expected -= 1
                self._expired_log.warn("expired", "%s half of room %s: no request with its prompt came",
                                       "decode" if e.handle.op == "recv" else "prefill", e.handle.room)
            self._compact(key)

    def _expect(self, peer: str, msg: B.Expect) -> None:
        h = msg.handle  # checked on decode (a malformed one is a refused frame)
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            q = self._expected.get(msg.key, ())
            reason = ""
            if self._n_expected >= _MAX_EXPECTED:
                reason = f"{self._n_expected} announced handoffs are waiting for their requests already"
            elif sum(e.alive for e in q) >= _MAX_EXPECTED_PER_KEY:
                reason = f"{_MAX_EXPECTED_PER_KEY} announced handoffs are waiting for a request with this prompt already"
            if reason:
                self.bus.send(peer, B.pack(B.Expected(key=msg.key, ok=False, nonce=msg.nonce, reason=reason), self._keyring))
                return
            e = _Announced(h, now + min(float(msg.ttl_s), _MAX_EXPECT_TTL_S))
            self._expected.setdefault(msg.key, deque()).append(e)
            heapq.heappush(self._expiry, (e.expires, next(self._expiry_seq), msg.key, e))
            self._n_expected += 1
        self.bus.send(peer, B.pack(B.Expected(key=msg.key, ok=True, nonce=msg.nonce), self._keyring))

    # -- declines and discovery ------------------------------------------------------------
    def _fall_back(self, rid: int, h: Handle, verdict: Any) -> None:
        """Below break-even: the executor computes the prompt here (no external tokens)."""
        log.info("kvbridge: request %s (room %s) computed on this server: %s", rid, h.room, verdict.reason)
        with self._lock:
            self.fallbacks[rid] = {"room": h.room, "reason": verdict.reason, "label": verdict.label,
                                   "prompt_len": verdict.prompt_len, "held": verdict.held_tokens}
            while len(self.fallbacks) > _LOG_KEEP:
                self.fallbacks.popitem(last=False)
        self._decline(rid, h, verdict.reason, verdict.label)

    def _decline(self, rid: int, h: Handle, reason: str, label: str) -> None:
        """Tell every prefill rank of the room that it will not be pulled (it lets the blocks go)."""
        self._route(B.Decline(req=rid, room=h.room, endpoints=list(h.endpoints), reason=reason[:4000], label=label), h)

    def _route(self, order: Any, h: Handle) -> None:
        """Issue ``order`` with the prefill's endpoints, discovering them first if needed."""
        if order.endpoints:
            with self._lock:
                self._issue(order)
            return
        key = h.prefill or h.bootstrap  # a tcp:// bus, or an SGLang bootstrap host:port
        with self._lock:
            eps = self._discovered.get(key)
            if eps:
                self._issue(msgspec.structs.replace(order, endpoints=eps))
                return
            first = key not in self._discovering
            full = ""
            if first and len(self._discovering) >= _MAX_PEERS:
                full = f"{len(self._discovering)} prefill servers are being discovered already"
            elif len(self._parked.get(key, ())) >= _MAX_PARKED:
                full = f"{_MAX_PARKED} orders wait for this prefill's endpoints already"
            if full:
                self._full_log.warn("full", "%s; %s for room %s fails", full, type(order).__name__, order.room)
                self._fail_orders([order], key, full)
                return
            self._parked.setdefault(key, []).append(order)
            self._discovering.setdefault(key, time.monotonic())
        if first:
            if h.prefill:
                self.bus.send(h.prefill, B.pack(B.Who(), self._keyring))
            else:
                threading.Thread(target=self._discover_bootstrap, args=(h.bootstrap,), daemon=True,
                                 name="kvbridge-trtllm-discover").start()

    def _discover_bootstrap(self, address: str) -> None:
        try:
            eps = endpoints_by_tp_rank(fetch_ranks(address, self.cfg.discovery_timeout_s, keyring=self._keyring), address)
        except (BootstrapError, ValueError) as e:
            with self._lock:
                if not self._closed and self._discovering.pop(address, None) is not None:
                    self._fail_parked(address, str(e))
            return
        with self._lock:
            if not self._closed:
                log.info("kvbridge scheduler: prefill at %s has %d rank(s): %s", address, len(eps), eps)
                self._on_discovered(address, eps)

    def _on_discovered(self, prefill: str, eps: list[str]) -> None:
        if self._discovering.pop(prefill, None) is None:
            # nobody asked this peer (or it answered too late): an unsolicited Endpoints names nothing we use
            self._full_log.warn("unsolicited", "Endpoints from %s, which was not asked; ignored", prefill)
            return
        if not eps:
            self._fail_parked(prefill, "prefill server reported no ranks")
            return
        self._discovered[prefill] = eps
        for order in self._parked.pop(prefill, []):
            if isinstance(order, B.Load) and order.req not in self._loads:
                continue  # the request ended meanwhile
            order = msgspec.structs.replace(order, endpoints=eps)
            if isinstance(order, B.Load):
                self._loads[order.req].order = order
            self._issue(order)

    def _fail_parked(self, prefill: str, reason: str) -> None:
        self._fail_orders(self._parked.pop(prefill, []), prefill, reason)

    def _fail_orders(self, orders: list, prefill: str, reason: str) -> None:
        """Fail ``orders`` (waiting for ``prefill``'s endpoints) naming ``reason``."""
        for order in orders:
            if isinstance(order, B.Decline):  # its room ends at the prefill's deadline
                log.warning("kvbridge: room %s: cannot tell prefill %s it was declined: %s", order.room, prefill, reason)
                continue
            load = self._loads.get(order.req)
            if load is not None:
                log.warning("kvbridge: request %s: cannot reach prefill %s: %s", order.req, prefill, reason)
                self._decide(order.req, load, ok=False, reason=f"cannot reach prefill {prefill}: {reason}")

    # -- orders and the bus ----------------------------------------------------------------
    def _issue(self, order: Any) -> None:
        """Number an order, queue it for the next metadata, send it to every worker (lock held)."""
        order = msgspec.structs.replace(order, seq=next(self._seq))
        self._unsent_meta.append(order)
        self._log[order.seq] = order
        while len(self._log) > _LOG_KEEP:
            self._log.popitem(last=False)
        payload = B.pack(B.Orders(orders=[order]), self._keyring)
        for ident in self._workers.values():
            self.bus.send(ident, payload)

    def _on_bus(self, peer: str, payload: bytes) -> None:
        msg = B.receive(payload, self._keyring, self._bad_bus, peer,
                        reply=lambda m: self.bus.send(peer, B.pack(m, self._keyring)))
        if msg is None:
            return
        if isinstance(msg, B.Expect):
            self._expect(peer, msg)
            return
        with self._lock:
            if isinstance(msg, B.Hello):
                if not 0 <= msg.rank < self.world_size:
                    self._bad_bus.warn("rank", "Hello from %s names rank %d of %d; ignored", peer, msg.rank,
                                       self.world_size)
                    return
                self._workers[msg.rank], self._endpoints[msg.rank] = peer, msg.endpoint
                if self.bootstrap is not None and msg.record is not None:
                    self.bootstrap.register(msg.rank, msg.record)
                log.info("kvbridge scheduler: rank %d joined (sender %s)", msg.rank, msg.endpoint)
                if self._log:
                    self.bus.send(peer, B.pack(B.Orders(orders=list(self._log.values())), self._keyring))
                self._answer_who()
            elif isinstance(msg, B.Who):
                self._who_waiting[peer] = None
                self._answer_who()
            elif isinstance(msg, B.Endpoints):
                self._on_discovered(peer, list(msg.endpoints))
            elif isinstance(msg, (B.LoadResult, B.Released)):
                # a rank's result or release counts only from that rank's worker (its Hello's connection)
                if not (msg.rank < self.world_size and self._workers.get(msg.rank) == peer):
                    self._bad_bus.warn(type(msg).__name__.lower(), "%s from %s for rank %d is not that rank's worker; ignored",
                                       type(msg).__name__, peer, msg.rank)
                elif isinstance(msg, B.LoadResult):
                    self._on_result(msg.req, msg.rank, msg.ok, msg.reason)
                else:
                    self.idle_wake.released(msg.req, msg.rank)
            else:
                log.warning("kvbridge scheduler: unexpected %s from %s", type(msg).__name__, peer)

    def _answer_who(self) -> None:
        if len(self._endpoints) < self.world_size or not self._who_waiting:
            return
        payload = B.pack(B.Endpoints(endpoints=[self._endpoints[r] for r in range(self.world_size)]), self._keyring)
        for peer in self._who_waiting:
            self.bus.send(peer, payload)
        self._who_waiting.clear()

    def _on_result(self, req: int, rank: int, ok: bool, reason: str) -> None:
        load = self._loads.get(req)
        if load is None or load.verdict:
            return
        load.results[rank] = (ok, reason)
        if not ok:
            log.warning("kvbridge: request %s (room %s): rank %d failed: %s", req, load.order.room, rank, reason)
        if len(load.results) >= self.world_size:
            self._decide(req, load, all(r[0] for r in load.results.values()))

    def _decide(self, req: int, load: _Load, ok: bool, reason: str = "") -> None:
        load.verdict = "ok" if ok else load.order.on_failure
        if load.verdict == "recompute":
            default_metrics().fallbacks.labels("receiver", "handoff_failed").inc()
        self._issue(B.Verdict(req=req, room=load.order.room, action=load.verdict, start=load.order.start,
                              reason=reason[:4000]))

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            for prefill, t0 in list(self._discovering.items()):
                # a bus answers at once; a bootstrap server's thread has its own deadline (this is a backstop)
                limit = self.cfg.peer_timeout_s if prefill.startswith("tcp://") else self.cfg.discovery_timeout_s + 5.0
                if now - t0 > limit:
                    self._discovering.pop(prefill, None)
                    self._fail_parked(prefill, f"no answer within {limit:.1f} s")
            self._expire(now)
        self.idle_wake.tick(now)

    def close(self) -> None:
        """Stop the bus (and the SGLang-compatible bootstrap server)."""
        if self in LOCAL_SCHEDULERS:
            LOCAL_SCHEDULERS.remove(self)
        with self._lock:
            self._closed = True
        if self.bootstrap is not None:
            self.bootstrap.close()
        self.bus.close()
