"""Every rank's half of the kvbridge TensorRT-LLM connector (``KVBridgeConnectorWorker``).

TensorRT-LLM builds it on every rank (``py_executor_creator``: ``worker_cls(llm_args)``);
the executor calls ``register_kv_caches`` once from
``PyExecutor._maybe_init_kv_connector_manager`` and the other hooks every iteration.
The worker owns the rank's pool registration, Mooncake transport, a kvbridge
``KVSender`` (prefill side) and ``KVReceiver`` (decode side), applies the scheduler's
orders (from the connector metadata or rank 0's bus, each once) and reports finished
handoffs in ``get_finished``.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, List, Tuple

import numpy as np
import torch

from kvbridge.common.control import ControlChannel
from kvbridge.common.handoff import KVReceiver, KVSender
from kvbridge.common.rank import BridgeRank
from kvbridge.common.limits import LogLimiter
from kvbridge.common.ordered_calls import OrderedCalls, stream_event

from . import bus as B
from ._compat import IDLE_WAIT_UNTIMED, KvCacheConnectorWorker
from .config import BridgeConfig, ConfigError, agree_with_rank0, settings_environ
from .geometry import model_scales, pool_layout, pull_plan, rank_geometry
from .idle import canceled_ids, forget_wake_ids
from .refusals import refuse_manager, refuse_unsupported
from .scheduler import LOCAL_SCHEDULERS, KVBridgeConnectorMetadata, world_size

__all__ = ["KVBridgeConnectorWorker"]

log = logging.getLogger(__name__)

_KEEP = 4096


@dataclass
class _Loading:
    req: int
    room: int
    start: int
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    reason: str = ""
    verdict: str = ""
    cancelled: bool = False
    started: bool = False
    gone: bool = False  # the engine dropped the request while it loaded


@dataclass
class _Saving:
    req: int
    room: int
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    opened: bool = False
    streamed_to: int = 0  # layer-wise: tokens [0, streamed_to) handed to the sender, every layer
    layer_pieces: int = 0  # layer-wise pieces handed to the sender
    ended_by: str = ""  # how the room's last chunk was given: "finish" (every layer streamed) or "send"
    pending_send: Any = None  # a Send that came before this rank's forward streamed the layers it expects
    layers_off: bool = False  # layer-wise streaming of this room gave up (the rest goes by Send)


@dataclass
class _LayerSend:
    """One request's tokens of the current forward, sent layer by layer (``SendLayers``)."""

    saving: _Saving
    blocks: np.ndarray
    start: int
    stop: int
    next_layer: int = 0


def find_executor() -> Any:
    """The PyExecutor whose ``_maybe_init_kv_connector_manager`` is calling
    ``register_kv_caches`` (a few frames up): its ``kv_cache_manager`` gives the pool's
    geometry, its ``active_requests`` and ``cancel_request`` what a failed load needs.

    Found as the caller because TensorRT-LLM offers no other way: ``PyExecutor`` hands
    ``register_kv_caches`` only the pool tensor (``kv_cache_manager.get_unique_primary_pool()``
    in ``_maybe_init_kv_connector_manager``, every version indexed), and neither the
    connector manager nor the worker it builds keeps a reference to the executor."""
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame else None
        for _ in range(8):
            if f is None:
                break
            obj = f.f_locals.get("self")
            if obj is not None and hasattr(obj, "active_requests") and hasattr(obj, "kv_connector_manager"):
                return obj
            f = f.f_back
    finally:
        del frame
    return None


def _bounded(d: OrderedDict, key: int, value: Any) -> None:
    d[key] = value
    while len(d) > _KEEP:
        d.popitem(last=False)


class KVBridgeConnectorWorker(KvCacheConnectorWorker):
    """Every rank's half of the connector."""

    def __init__(self, llm_args: Any, *, config: BridgeConfig | None = None):
        super().__init__(llm_args)
        refuse_unsupported(llm_args)
        self.cfg = config or BridgeConfig.load(llm_args=llm_args)
        self._configured = config is not None or bool(settings_environ(llm_args))  # did any setting reach this rank
        self.layout = None
        self.rank_side: BridgeRank | None = None  # the transport, sender and receiver (register_kv_caches)
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
        self._loads: dict[int, _Loading] = {}
        self._sends: dict[int, _Saving] = {}
        self._announced_loading: set[int] = set()
        self._announced_saving: set[int] = set()
        self._forget_sent: set[int] = set()
        self._rewound: set[int] = set()  # requests rewound for recompute whose chunk is still to be widened
        self._forward: list[_LayerSend] = []  # layer-wise sends of the forward in progress
        # sender calls of layer-wise rooms, in order: at once on CPU; on CUDA each after the
        # event recorded where its layers were written (and a room's Send after its layers)
        self._dispatch = OrderedCalls("kvbridge-trtllm-layers")
        self._missing_hook_logged = False
        self.finished_loads: OrderedDict[int, dict] = OrderedDict()  # request id -> how its load ended
        self.finished_saves: OrderedDict[int, dict] = OrderedDict()  # request id -> how its send ended (+ record)
        self.declined: OrderedDict[int, dict] = OrderedDict()  # request id -> record of its declined room (rank 0)
        self._idle_wake = None  # rank 0, 1.2: wakes the idle executor for released blocks (kvbridge.adapters.trtllm.idle)
        self._wake_ids = IDLE_WAIT_UNTIMED  # 1.2: tell rank 0 when blocks are let go, clear its wake ids
        self._released_ids: OrderedDict[int, None] = OrderedDict()  # requests whose blocks this rank let go of (1.2)
        self._released_lock = threading.Lock()  # release callbacks run on the sender's threads
        self._apply_order = {B.Open: self._open, B.Send: self._send_in_order, B.Load: self._load, B.Verdict: self._verdict,
                             B.Decline: self._decline, B.Drop: self._drop}

    # -- KvCacheConnectorWorker (TensorRT-LLM calls these on every rank) ------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor):
        """Called once by ``PyExecutor._maybe_init_kv_connector_manager`` with the rank's
        primary pool ``[num_blocks, layers, kv_factor, heads * tokens_per_block *
        head_dim]`` (HND inside a block): describe it from the executor's KV cache
        manager, register it with Mooncake, start the sender and receiver, join rank 0's bus."""
        if self.layout is not None:
            raise RuntimeError("register_kv_caches called twice")
        self._scheduler_ep = self._join_rank0(world_size(self._llm_args, self.cfg))  # settings agreed first
        self._executor = find_executor()
        if self._executor is not None:
            refuse_manager(self._executor.kv_cache_manager)
        else:
            log.warning("kvbridge worker: register_kv_caches was not called by a TensorRT-LLM executor; the geometry "
                        "comes from the pool and the model config, and failed loads cannot fall back to recompute")
        geo = rank_geometry(kv_cache_tensor, manager=getattr(self._executor, "kv_cache_manager", None),
                            dist=getattr(self._executor, "dist", None), llm_args=self._llm_args, cfg=self.cfg)
        self.rank, self.tp_size = geo.tp_rank, geo.tp_size
        self._hold_engine_frees()
        self._attach_idle_wake()
        self.layout = model_scales(self._executor, pool_layout(kv_cache_tensor, geo))
        cfg = self.cfg
        self.rank_side = BridgeRank(cfg, "trtllm")
        self.sender = self.rank_side.start_sender(self.layout)
        self.receiver = self.rank_side.start_receiver(self.layout)
        log.info("kvbridge worker rank %d/%d: %s pool, %d blocks x %d tokens, %d KV head(s) of %d x %s; sender %s",
                 self.rank, self.tp_size, self.layout.engine, self.layout.num_blocks, self.layout.tokens_per_block,
                 self.layout.num_heads, self.layout.head_dim, self.layout.dtype, self.sender.endpoint)
        self._keyring = cfg.keyring()  # the bus is sealed as the control channel is (kvbridge.common.auth)
        self._bad_bus = LogLimiter(log, f"kvbridge worker rank {self.rank}: refused bus messages")
        self.bus = ControlChannel(self._on_bus, None, name=f"kvbridge-trtllm-worker{self.rank}")
        hello = B.Hello(rank=self.rank, endpoint=self.sender.endpoint, record=self.rank_side.record())
        self.bus.send(self._scheduler_ep, B.pack(hello, self._keyring))

    def _join_rank0(self, world: int) -> str:
        """Rank 0's bus, and the settings this rank runs with: in this process on rank 0;
        elsewhere rank 0's endpoint and settings by MPI broadcast (every rank registers in
        the same executor start-up step), checked against this rank's own
        (``config.agree_with_rank0``: a rank no setting reached takes rank 0's); or
        ``scheduler_endpoint`` where ranks cannot use MPI (then set on every rank)."""
        import socket

        local = LOCAL_SCHEDULERS[-1].endpoint if LOCAL_SCHEDULERS else ""
        if self.cfg.scheduler_endpoint:
            ep = local if self.cfg.scheduler_endpoint == "local" else self.cfg.scheduler_endpoint
        elif world > 1:
            try:
                from tensorrt_llm._utils import mpi_broadcast, mpi_rank
            except ImportError as e:
                raise ConfigError(f"this rank cannot learn rank 0's kvbridge bus over MPI ({e}); "
                                  "set scheduler_endpoint (KVBRIDGE_SCHEDULER_ENDPOINT) on every rank") from e
            rank, here = int(mpi_rank()), socket.gethostname()
            ep, cfg0, configured0, host0 = mpi_broadcast(
                (local or None, self.cfg, self._configured, here) if rank == 0 else None, root=0)
            agreed = agree_with_rank0(self.cfg, self._configured, cfg0, configured0, rank, host0 == here)
            if agreed is not self.cfg:
                log.info("kvbridge worker rank %d: no setting reached this rank; running with rank 0's", rank)
            self.cfg = agreed
        else:
            ep = local
        if not ep:
            raise ConfigError("no kvbridge scheduler in this process and no scheduler_endpoint set")
        return ep

    def start_load_kv(self, stream: Any):
        """Called by ``_kv_connector_start_batch`` after ``bind_connector_meta``, before the
        forward, in iterations that schedule a batch: apply the orders of this step's
        metadata the bus has not delivered yet (transfers run in the background)."""
        meta = self.get_connector_meta()
        if isinstance(meta, KVBridgeConnectorMetadata):
            self._apply(meta.orders)
            self._arm_layer_sends(getattr(meta, "layers", None) or [])
        if self._rewound:
            self._widen_rewound_chunks()

    def wait_for_layer_load(self, layer_idx: int, stream: Any):
        """Called by the forward pre-hook of decoder layer ``layer_idx``: nothing to wait
        for, a loading request is not scheduled until every layer has landed."""

    def save_kv_layer(self, layer_idx: int, stream: Any):
        """Called by the forward hook after decoder layer ``layer_idx`` wrote its KV (every
        rank, on the forward's thread; ``stream``: the forward's ``torch.cuda.Stream``).
        Layer-wise (``layerwise`` on): hands layer ``layer_idx`` of the tokens this forward
        computes, for every prefill half in the batch whose room is open, to the sender,
        which writes it while the next layers compute; returns at once. On CUDA pools the
        sender is called on the dispatcher's thread once an event recorded on ``stream``
        here has completed: the forward stream never waits on the network. Otherwise
        nothing: a prompt's KV is sent once its request finished its prefill."""
        if self._forward:
            self._send_layers(int(layer_idx) + 1, self._event(stream))

    def wait_for_save(self, stream: Any):
        """Called at the end of the forward (``_forward_step``, before sampling): nothing
        to wait for, sends are asynchronous and their blocks stay held until
        ``get_finished`` reports them. Layer-wise: layers whose hook did not fire are
        handed over now (said once in the log), and a Send that came during the forward
        is applied."""
        if not self._forward:
            return
        if any(ls.next_layer < self.layout.num_layers for ls in self._forward) and not self._missing_hook_logged:
            self._missing_hook_logged = True
            log.warning("kvbridge worker rank %d: save_kv_layer did not fire for every layer of a forward; the "
                        "layers it missed are sent after the forward", self.rank)
        self._send_layers(self.layout.num_layers, self._event(stream))
        with self._lock:
            done, self._forward = self._forward, []
            pending = [ls.saving.pending_send for ls in done if ls.saving.pending_send is not None]
            for ls in done:
                ls.saving.pending_send = None
        for o in pending:
            self._send_in_order(o)

    # -- layer-wise sends -------------------------------------------------------------------
    def _arm_layer_sends(self, orders: list) -> None:
        """This forward's ``SendLayers`` (from the metadata): the requests whose room is open
        here and whose tokens it computes."""
        armed, unblocked = [], []
        with self._lock:
            for o in orders:
                s = self._sends.get(o.req)
                if s is None or not s.opened or s.released.is_set() or s.ended_by or s.layers_off:
                    continue
                if o.start != s.streamed_to:
                    log.error("kvbridge worker rank %d: request %s: layer-wise tokens [%d, %d) after %d were streamed; "
                              "its room is sent whole", self.rank, o.req, o.start, o.stop, s.streamed_to)
                    s.layers_off = True
                    if s.pending_send is not None:  # it waited for these layers: they will not come
                        unblocked.append(s.pending_send)
                        s.pending_send = None
                    continue
                armed.append(_LayerSend(s, np.asarray(o.blocks, dtype=np.int64), o.start, o.stop))
            self._forward = armed
        for o in unblocked:
            self._send_in_order(o)

    def _send_layers(self, upto: int, event: Any = None) -> None:
        """Hand layers ``[next, upto)`` of every armed request to the sender (through the
        dispatcher: at once, or after ``event`` on CUDA). The bookkeeping is done here and
        now, so the next hook and the next forward's arming see it at once."""
        nl = self.layout.num_layers
        upto = min(upto, nl)
        for ls in self._forward:
            if ls.next_layer >= upto:
                continue
            s, layers = ls.saving, (ls.next_layer, upto)
            s.layer_pieces += 1
            ls.next_layer = upto
            if upto == nl:
                s.streamed_to = ls.stop
            self._dispatch.call(partial(self._send_piece, s, ls.blocks, ls.start, ls.stop, layers), event)

    def _send_piece(self, s: _Saving, blocks: np.ndarray, start: int, stop: int, layers: tuple[int, int]) -> None:
        """One layer-wise piece to the sender (dispatcher). A failed piece aborts the room,
        and the pieces after it are not sent."""
        with self._lock:
            if s.ended_by == "abort":
                s.layer_pieces -= 1
                return
            try:
                self.sender.send_chunk(s.room, blocks, start, stop, last=False, layers=layers)
            except (KeyError, ValueError) as e:  # the room ended or a bookkeeping bug: the decode side recomputes
                log.error("kvbridge worker rank %d: request %s: layer-wise send of room %s failed: %s", self.rank,
                          s.req, s.room, e)
                self.sender.abort(s.room, f"layer-wise send failed: {e}")
                s.ended_by = "abort"  # a Send for it (now or pending) sends nothing more
                s.layer_pieces -= 1

    def _event(self, stream: Any) -> Any:
        """An event recorded now on ``stream`` (the forward's) when the pools are CUDA
        memory, else None (the layers are in host memory already)."""
        dev = getattr(self.layout, "device", None)
        if dev is None or dev.type != "cuda":
            return None
        return stream_event(stream)

    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """Called by the connector manager every iteration on every rank (then allgathered;
        only ids every rank reports count): (saved, loaded). Saved: prefill halves whose
        sender released the blocks. Loaded: decode halves whose verdict from rank 0 is in
        (a failed load rewound to be recomputed, or cancelled, first). Only ids announced
        in these arguments are returned."""
        with self._lock:
            self._announced_saving.update(int(i) for i in finished_gen_req_ids)
            self._announced_loading.update(int(i) for i in started_loading_req_ids)
            saved = [r for r, s in self._sends.items() if s.released.is_set() and r in self._announced_saving]
            for r in saved:
                s = self._sends.pop(r)
                rec = self.sender.record(s.room) if s.opened else None
                _bounded(self.finished_saves, r, {"room": s.room, "ok": s.ok, "record": rec.as_dict() if rec else None,
                                                  "layer_pieces": s.layer_pieces, "ended_by": s.ended_by})
                self._forget_sent.add(s.room)
                self._announced_saving.discard(r)
            for room in list(self._forget_sent):  # a room is forgettable once its last write returned
                self.sender.forget(room)
                if self.sender.record(room) is None:
                    self._forget_sent.discard(room)
            self._abort_cancelled_loads()
            self._free_held()
            if self._wake_ids and self._executor is not None:
                forget_wake_ids(self._executor, self._let_go_of)
            if self._idle_wake is not None:
                self._idle_wake.polled()
            loaded = []
            for r, ld in list(self._loads.items()):
                if r in self._announced_loading and ld.verdict and self._settle_load(ld):
                    loaded.append(r)
                    del self._loads[r]
                    self._announced_loading.discard(r)
                    done = {"room": ld.room, "ok": ld.ok and not ld.gone, "reason": ld.reason, "verdict": ld.verdict,
                            "cancelled_by_engine": ld.gone}
                    if ld.started:
                        rec = self.receiver.record(ld.room)
                        done.update(aux=self.receiver.aux(ld.room), record=rec.as_dict() if rec else None)
                        self.receiver.forget(ld.room)
                    _bounded(self.finished_loads, r, done)
        return saved, loaded

    # -- orders ---------------------------------------------------------------------------
    def _on_bus(self, peer: str, payload: bytes) -> None:
        msg = B.receive(payload, self._keyring, self._bad_bus, peer)
        if msg is None:
            return
        if isinstance(msg, B.Orders):
            self._apply(msg.orders)

    def _apply(self, orders: list) -> None:
        for o in orders:
            with self._lock:
                if o.seq <= self._seen_floor or o.seq in self._seen:
                    continue
                self._seen.add(o.seq)
                if len(self._seen) > 2 * _KEEP:
                    self._seen_floor = sorted(self._seen)[-_KEEP]
                    self._seen = {s for s in self._seen if s > self._seen_floor}
                try:
                    self._apply_order[type(o)](o)
                except Exception:
                    log.exception("kvbridge worker rank %d: %s order for request %s failed", self.rank,
                                  type(o).__name__, o.req)

    def _load(self, o: B.Load) -> None:
        ld = self._loads.setdefault(o.req, _Loading(o.req, o.room, o.start))
        try:
            eps = list(o.endpoints)
            plan = pull_plan(self.layout.total_heads, len(eps), self.tp_size, self.rank)

            def release(_blocks, ok, ld=ld):
                ld.ok = ok
                ld.reason = "" if ok else self.receiver.failure_reason(ld.room)
                ld.released.set()
                self._report(ld)
                if any(h[0] is ld for h in getattr(self, "_held_frees", ())):
                    self._let_go(ld.req)  # the engine's free we held can go now

            self.receiver.request(o.room, [eps[i] for i in plan.ranks], np.asarray(o.blocks, dtype=np.int64), ld.start,
                                  o.stop, release, receivers=plan.receivers)
            ld.started = True
        except Exception as e:
            log.warning("kvbridge worker rank %d: request %s: cannot pull room %s: %s", self.rank, o.req, o.room, e)
            ld.ok, ld.reason = False, f"{type(e).__name__}: {e}"
            ld.released.set()
            self._report(ld)

    def _report(self, ld: _Loading) -> None:
        self.bus.send(self._scheduler_ep, B.pack(B.LoadResult(req=ld.req, rank=self.rank, ok=ld.ok,
                                                               reason=ld.reason[:4000]), self._keyring))

    def _attach_idle_wake(self) -> None:
        """Rank 0 on 1.2: let the scheduler's ``IdleWake`` wake this executor (a cancel of a
        finished request id through ``cancel_request``) when released blocks wait for an
        iteration; only where the executor's cancelled ids can be found, to clear them again."""
        if not self._wake_ids or self._executor is None:
            return
        if canceled_ids(self._executor) is None or not hasattr(self._executor, "cancel_request"):
            log.warning("kvbridge worker rank %d: this TensorRT-LLM executor has no cancel_request/canceled_req_ids; "
                        "an idle executor is not woken, so a prefill's blocks come back at its next request",
                        self.rank)
            self._wake_ids = False
            return
        if self.rank == 0 and LOCAL_SCHEDULERS:
            self._idle_wake = LOCAL_SCHEDULERS[-1].idle_wake
            self._idle_wake.attach(self._executor.cancel_request)

    def _let_go_of(self, req: int) -> bool:
        """Whether this rank let go of request ``req``'s blocks (recently: the last ``_KEEP``)."""
        with self._released_lock:
            return req in self._released_ids

    def _let_go(self, req: int) -> None:
        """Any thread: this rank let go of request ``req``'s blocks; rank 0 learns it (1.2)."""
        if not self._wake_ids:
            return
        with self._released_lock:
            _bounded(self._released_ids, int(req), None)
        self.bus.send(self._scheduler_ep, B.pack(B.Released(req=int(req), rank=self.rank), self._keyring))

    def _verdict(self, o: B.Verdict) -> None:
        ld = self._loads.setdefault(o.req, _Loading(o.req, o.room, o.start))
        ld.verdict = o.action
        if o.reason and not ld.reason:
            ld.reason = o.reason

    def _decline(self, o: B.Decline) -> None:
        """The decode computes the prompt itself (rank 0 speaks for every rank): each prefill
        rank of the room is told it will not be pulled, so it releases the room's blocks."""
        if self.rank != 0:
            return
        rec = self.receiver.decline(o.room, list(o.endpoints), o.reason, label=o.label)
        _bounded(self.declined, o.req, rec.as_dict())

    def _open(self, o: B.Open | B.Send) -> None:
        if o.req in self._sends or o.req in self.finished_saves:
            return  # open already, or over: a Send after the room was reported saved (e.g. declined) reopens nothing
        s = self._sends[o.req] = _Saving(o.req, o.room)

        def release(_blocks, ok, s=s):
            s.ok = ok
            s.released.set()
            self._let_go(s.req)

        try:
            self.sender.add_room(o.room, np.asarray(o.blocks, dtype=np.int64), release)
            s.opened = True
        except ValueError as e:  # the room id is already open here: a router error
            log.error("kvbridge worker rank %d: request %s: %s", self.rank, o.req, e)
            s.released.set()

    def _send_in_order(self, o: B.Send) -> None:
        """A Send, applied after every layer-wise piece handed over before it (on CPU at
        once; on CUDA its ``finish`` must not overtake layers still waiting on the device)."""
        def apply(o=o):
            with self._lock:
                self._send(o)
        self._dispatch.call(apply)

    def _send(self, o: B.Send) -> None:
        """The prefill half finished (its first token sampled): its room's last chunk. After
        a layer-wise prefill only what no forward streamed is left (usually nothing: the
        first token then rides with the sender's ``finish``)."""
        self._open(o)  # no-op when the room was opened at admission
        s = self._sends.get(o.req)
        if s is None or not s.opened or s.ended_by:
            return
        with self._lock:
            # Rank 0 issues the Send once its own forward is done; this rank may still be
            # streaming that forward's layers, or not have started it (it lags rank 0): the
            # Send waits for them and is applied at the end of that forward (wait_for_save).
            if any(ls.saving is s for ls in self._forward) or (s.streamed_to < o.layered_to and not s.layers_off):
                s.pending_send = o
                return
        aux = {"output_ids": [o.first_token]} if o.first_token >= 0 else None
        if s.streamed_to >= o.stop:
            s.ended_by = "finish"
            self.sender.finish(o.room, aux)
            return
        s.ended_by = "send"
        self.sender.send_chunk(o.room, np.asarray(o.blocks, dtype=np.int64), s.streamed_to, o.stop, last=True,
                               first_token=0, aux=aux)

    def _drop(self, o: B.Drop) -> None:
        s = self._sends.pop(o.req, None)
        if s is not None and s.opened:
            self.sender.abort(s.room, o.reason or "prefill request ended")
            self._forget_sent.add(s.room)

    # -- a load's end ---------------------------------------------------------------------
    def _settle_load(self, ld: _Loading) -> bool:
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
            self._rewound.add(ld.req)
            log.warning("kvbridge worker rank %d: request %s recomputes tokens %d.. after a failed handoff",
                        self.rank, ld.req, ld.start)
            return True
        # "fail": the same rewind (so whatever runs before the cancel lands computes correct
        # KV), and rank 0 cancels the request through the executor's request queue
        if req is not None:
            req.context_current_position = ld.start
            self._rewound.add(ld.req)
        if self.rank == 0 and hasattr(self._executor, "cancel_request"):
            log.warning("kvbridge: request %s failed to load; cancelling it", ld.req)
            self._executor.cancel_request(ld.req)
        return True

    def _hold_engine_frees(self) -> None:
        """TensorRT-LLM 1.2 frees a request cancelled while its KV loads at once
        (``KVCacheManager.free_resources`` from ``_terminate_request``): the one free the
        connector API gives no say in. On one rank the plugin holds that free: a loading
        request's blocks are freed only once no sender can write into them (the room is
        aborted at once, so the senders stop and prove it). With TP > 1 the ranks would
        free at different iterations and their block pools diverge, so the free stays
        TensorRT-LLM's (adapters/trtllm/README.md, Limits)."""
        kvm = getattr(self._executor, "kv_cache_manager", None)
        free = getattr(kvm, "free_resources", None)
        if free is None or self.tp_size != 1 or getattr(free, "_kvbridge_held", False):
            return
        self._held_frees: list[tuple[_Loading, tuple, dict]] = []

        def free_resources(request, *args, **kwargs):
            rid = getattr(request, "py_request_id", None)
            rid = getattr(request, "request_id", None) if rid is None else rid
            with self._lock:
                ld = self._loads.get(rid)
                if ld is not None and ld.started and not ld.released.is_set():
                    ld.gone = True
                    self._held_frees.append((ld, (request, *args), kwargs))
                    held = True
                else:
                    held = False
            if not held:
                return free(request, *args, **kwargs)
            log.warning("kvbridge worker rank %d: request %s was freed by the engine while its KV loaded; its blocks "
                        "are held until no sender can write into them (room %s aborted)", self.rank, rid, ld.room)
            self.receiver.abort(ld.room, "the engine cancelled the request while its KV loaded")
            return None

        free_resources._kvbridge_held = True
        kvm.free_resources = free_resources
        self._engine_free = free

    def _free_held(self) -> None:
        """Executor thread (``get_finished``): the engine frees held by ``_hold_engine_frees``
        whose loads are now quiet."""
        held = getattr(self, "_held_frees", None)
        if not held:
            return
        ready = [h for h in held if h[0].released.is_set()]
        if not ready:
            return
        self._held_frees = [h for h in held if not h[0].released.is_set()]
        for ld, args, kwargs in ready:
            self._engine_free(*args, **kwargs)

    def _abort_cancelled_loads(self) -> None:
        """A load whose request the engine has dropped (its client cancelled it) is aborted:
        on 1.2 TensorRT-LLM frees such a request's blocks at once (the connector API has no
        hook for it), so the prefill must stop writing into them as soon as we can tell.
        Pieces already in flight can still land: see adapters/trtllm/README.md, Limits."""
        loading = [ld for ld in self._loads.values() if ld.started and not ld.gone and not ld.released.is_set()]
        if self._executor is None or not loading:
            return
        active = {getattr(r, "request_id", None) for r in getattr(self._executor, "active_requests", None) or ()}
        for ld in loading:
            if ld.req not in active:
                ld.gone = True
                log.warning("kvbridge worker rank %d: request %s was dropped by the engine while its KV loaded; "
                            "aborting room %s", self.rank, ld.req, ld.room)
                self.receiver.abort(ld.room, "the engine cancelled the request while its KV loaded")

    def _widen_rewound_chunks(self) -> None:
        """A request rewound for recompute is back in the context phase now: its chunk is
        still the one token TensorRT-LLM left after the load (``setPrepopulatedPromptLen``
        clamps it, ``moveToNextContextChunk`` zeroes it, and without chunked prefill nothing
        sets it again), so it is set to the rest of the prompt (the setter refuses outside
        the context phase; the scheduler's own chunk wins under chunked prefill)."""
        with self._lock:
            rewound, self._rewound = self._rewound, set()
        for rid in rewound:
            req = self._request(rid)
            if req is None:
                continue
            if getattr(req.state, "name", "") != "CONTEXT_INIT":
                with self._lock:
                    self._rewound.add(rid)  # not scheduled yet: next time
                continue
            if not getattr(self._llm_args, "enable_chunked_prefill", False) or req.context_chunk_size <= 0:
                try:
                    req.context_chunk_size = req.context_remaining_length
                except RuntimeError as e:
                    log.error("kvbridge worker rank %d: request %s: cannot set its chunk for the recompute: %s",
                              self.rank, rid, e)

    def _request(self, req_id: int) -> Any:
        for r in getattr(self._executor, "active_requests", None) or ():
            if getattr(r, "request_id", None) == req_id:
                return r
        return None

    def close(self) -> None:
        """Stop the bus, the dispatcher (after what it holds), sender, receiver and transport."""
        if self.bus is not None:
            self.bus.close()
        self._dispatch.close()
        if self.rank_side is not None:
            self.rank_side.close()
