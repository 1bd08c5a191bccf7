"""A TensorRT-LLM cache transceiver over kvbridge (``KvCacheTransceiver``).

The same handoff as the connector, through TensorRT-LLM's own disaggregated flow:
context-only requests on the prefill server, generation-only requests on the decode
server, the prompt's first generated token carried by ``ContextPhaseParams``. Interface
followed: ``tensorrt_llm/_torch/pyexecutor/kv_cache_transceiver.py`` (``KvCacheTransceiver``;
``create_kv_cache_transceiver(mapping, dist, kv_cache_manager, attention_type,
cache_transceiver_config)`` builds the built-in ones) and its call sites in
``py_executor.py``: ``_send_kv_async`` calls ``respond_and_send_async`` for context-only
requests whose context finished, then ``_check_disagg_ctx_cache_transfer_status`` ->
``check_context_transfer_status(n)``, which returns (finished ids, error ids);
``_recv_disagg_gen_cache`` calls ``request_and_receive_async`` for generation requests
whose blocks were just allocated, then ``check_gen_transfer_status(n)``, and
``_prepare_disagg_gen_transmission_complete`` takes requests in
DISAGG_GENERATION_TRANS_COMPLETE into generation with
``context_phase_params.first_gen_tokens``; ``cancel_request`` is retried until it
returns True; the executor reads ``kv_transfer_timeout_ms``.

Discovery: ``respond_and_send_async`` sets the request's ``context_phase_params`` with
the first generated token and, as ``opaque_state``, a kvbridge handle naming the room
and every prefill rank's control endpoint; the context result's
``disaggregated_params`` carry it to the router, which passes them to the generation
request (``request_type="generation_only"``), where ``request_and_receive_async`` reads it.

Ranks agree: each status check gathers every rank's finished and failed rooms
(``dist.allgather``), so a request completes, or errors, on all ranks in the same
iteration.

Installing it: TensorRT-LLM picks its transceiver in ``create_kv_cache_transceiver``, a
fixed factory with no registry, and ``CacheTransceiverConfig.backend`` accepts only its
own backend names; ``install()`` (an explicit monkeypatch of that factory, to run in
every rank before the executor is built) is the only way in without editing TensorRT-LLM.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from kvbridge.common.handoff import KVReceiver, KVSender

from ._compat import KvCacheTransceiver, llm_request_state, make_context_phase_params
from .config import BridgeConfig
from .geometry import layout_from_kv_cache_manager, pull_plan
from .handle import Handle, HandleError, handle_of

__all__ = ["KVBridgeCacheTransceiver", "install"]

log = logging.getLogger(__name__)


@dataclass
class _Room:
    req: Any
    room: int
    released: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    started: bool = False


class KVBridgeCacheTransceiver(KvCacheTransceiver):
    """Cache transceiver of one rank: a kvbridge sender and receiver on the KV cache
    manager's primary pool."""

    def __init__(self, mapping: Any, dist: Any, kv_cache_manager: Any, attention_type: Any = None,
                 cache_transceiver_config: Any = None, *, config: BridgeConfig | None = None):
        from kvbridge.common.transport import MooncakeTransport

        self.cfg = config or BridgeConfig.load()
        self.dist = dist
        self.kv_cache_manager = kv_cache_manager
        self.kv_transfer_timeout_ms = getattr(cache_transceiver_config, "kv_transfer_timeout_ms", None)
        if getattr(mapping, "enable_attention_dp", False):
            raise NotImplementedError("the kvbridge transceiver does not support attention data parallelism")
        self.tp_rank, self.tp_size = int(getattr(mapping, "tp_rank", 0)), int(getattr(mapping, "tp_size", 1))
        self.layout = layout_from_kv_cache_manager(kv_cache_manager, self.tp_rank, self.tp_size, self.cfg.dtype)
        cfg = self.cfg
        self.transport = MooncakeTransport(cfg.host, cfg.metadata_server, cfg.protocol, cfg.device_name)
        self.sender = KVSender(self.layout, self.transport, host=cfg.host, config=cfg.handoff())
        self.receiver = KVReceiver(self.layout, self.transport, config=cfg.handoff())
        self.endpoints = [str(e) for e in dist.allgather(self.sender.endpoint)]  # in rank order
        self._lock = threading.RLock()
        self._sends: dict[int, _Room] = {}
        self._recvs: dict[int, _Room] = {}

    # -- prefill ------------------------------------------------------------------------
    def respond_and_send_async(self, req: Any):
        """A context-only request finished its context: serve its KV from its blocks and
        publish where (``req.context_phase_params``)."""
        rid = int(req.py_request_id)
        h = _safe_handle(req)
        room = h.room if h is not None and h.op == "send" else rid
        blocks = np.asarray(self.kv_cache_manager.get_cache_indices(req), dtype=np.int64)
        prompt_len = int(req.prompt_len)
        tokens = list(req.get_tokens(0))
        first = [int(t) for t in tokens[prompt_len:prompt_len + 1]]
        r = _Room(req, room)
        with self._lock:
            self._sends[rid] = r
        self.sender.add_room(room, blocks, lambda _b, ok, r=r: _released(r, ok))
        r.started = True
        self.sender.send_chunk(room, blocks, 0, prompt_len, last=True, aux={"output_ids": first} if first else None)
        opaque = Handle("recv", room, endpoints=tuple(self.endpoints)).to_json()
        req.context_phase_params = make_context_phase_params(first, rid, opaque)
        req.state = llm_request_state("DISAGG_CONTEXT_TRANS_IN_PROGRESS")

    def check_context_transfer_status(self, at_least_request_num: int):
        """Wait until at least ``at_least_request_num`` sends ended on every rank; returns
        (finished request ids, failed request ids) and sets their states."""
        done, failed = self._settle(self._sends, at_least_request_num)
        for rid in done:
            self._sends[rid].req.state = llm_request_state("DISAGG_CONTEXT_COMPLETE")
        for rid in failed:
            self._sends[rid].req.state = llm_request_state("DISAGG_TRANS_ERROR")
        with self._lock:
            for rid in done + failed:
                self.sender.forget(self._sends.pop(rid).room)
        return done, failed

    # -- decode -------------------------------------------------------------------------
    def request_and_receive_async(self, req: Any):
        """A generation-only request has blocks for its prompt: pull the prompt's KV into them."""
        rid = int(req.py_request_id)
        h = self._recv_handle(req)
        blocks = np.asarray(self.kv_cache_manager.get_cache_indices(req), dtype=np.int64)
        r = _Room(req, h.room)
        with self._lock:
            self._recvs[rid] = r
        req.state = llm_request_state("DISAGG_GENERATION_TRANS_IN_PROGRESS")
        try:
            plan = pull_plan(self.layout.total_heads, len(h.endpoints), self.tp_size, self.tp_rank)
            self.receiver.request(h.room, [h.endpoints[i] for i in plan.ranks], blocks, 0, int(req.prompt_len),
                                  lambda _b, ok, r=r: _released(r, ok), receivers=plan.receivers)
            r.started = True
        except Exception as e:
            log.warning("kvbridge transceiver: request %s: cannot pull room %s: %s", rid, h.room, e)
            _released(r, False)

    def request_and_receive_sync(self, req: Any):
        """``request_and_receive_async`` and wait for it (on every rank)."""
        self.request_and_receive_async(req)
        while int(req.py_request_id) in self._recvs:
            self.check_gen_transfer_status(1)

    def check_gen_transfer_status(self, at_least_request_num: int):
        """Wait until at least ``at_least_request_num`` receives ended on every rank; their
        requests go to DISAGG_GENERATION_TRANS_COMPLETE, or DISAGG_TRANS_ERROR when any
        rank failed."""
        done, failed = self._settle(self._recvs, at_least_request_num)
        for rid in done:
            self._recvs[rid].req.state = llm_request_state("DISAGG_GENERATION_TRANS_COMPLETE")
        for rid in failed:
            self._recvs[rid].req.state = llm_request_state("DISAGG_TRANS_ERROR")
        with self._lock:
            for rid in done + failed:
                r = self._recvs.pop(rid)
                if r.started:
                    self.receiver.forget(r.room)

    def check_gen_transfer_complete(self):
        """True when no receive is in flight."""
        return not self._recvs

    def cancel_request(self, req: Any):
        """Abort the request's handoff; True once nothing can still touch its blocks."""
        rid = int(req.py_request_id)
        for rooms, side in ((self._sends, self.sender), (self._recvs, self.receiver)):
            r = rooms.get(rid)
            if r is None:
                continue
            if r.started and not r.released.is_set():
                side.abort(r.room, "cancelled by the engine")
                return False
            with self._lock:
                rooms.pop(rid, None)
            if r.started:
                side.forget(r.room)
        return True

    def prepare_context_requests(self, requests: List[Any]):
        """Generation-first scheduling is not used: context requests run at once."""
        for req in requests:
            req.state = llm_request_state("CONTEXT_INIT")

    def get_disaggregated_params(self) -> Dict[str, Any]:
        """Nothing: decode servers learn the prefill ranks from each context result."""
        return {}

    def shutdown(self):
        """Stop the sender, receiver and transport."""
        self.receiver.close()
        self.sender.close()
        self.transport.close()

    # -- helpers ------------------------------------------------------------------------
    def _recv_handle(self, req: Any) -> Handle:
        cpp = getattr(req, "context_phase_params", None)
        state = getattr(cpp, "opaque_state", None)
        if state:
            return Handle.from_json(bytes(state))
        h = handle_of(req)
        if h is None or h.op != "recv":
            raise HandleError(f"request {req.py_request_id} carries no kvbridge handle in its context phase params")
        return h

    def _settle(self, rooms: dict[int, _Room], at_least: int) -> tuple[list[int], list[int]]:
        """Rooms every rank finished (and those any rank failed), waiting for ``at_least``."""
        deadline = time.monotonic() + self.cfg.deadline_s + self.cfg.quiesce_s + 1.0
        while True:
            with self._lock:
                mine = {rid: r.ok for rid, r in rooms.items() if r.released.is_set()}
            # one collective per round; every rank takes the same decision from the same data
            everyone = self.dist.allgather((mine, time.monotonic() > deadline))
            ended = set.intersection(*[set(m) for m, _ in everyone])
            failed = sorted(rid for rid in ended if not all(m[rid] for m, _ in everyone))
            done = sorted(ended - set(failed))
            if len(ended) >= min(at_least, len(rooms)) or any(expired for _, expired in everyone):
                return done, failed
            time.sleep(0.001)


def _released(r: _Room, ok: bool) -> None:
    r.ok = ok
    r.released.set()


def _safe_handle(req: Any) -> Handle | None:
    try:
        return handle_of(req)
    except HandleError as e:
        log.warning("kvbridge transceiver: request %s: %s", getattr(req, "py_request_id", "?"), e)
        return None


def install() -> None:  # pragma: no cover - needs TensorRT-LLM
    """Make TensorRT-LLM build this transceiver: replaces ``create_kv_cache_transceiver``
    in ``py_executor_creator`` (a monkeypatch; call it in every rank's process before the
    executor is created). Selected when ``KVBRIDGE_TRANSCEIVER=1``; otherwise the original
    factory runs."""
    import os

    from tensorrt_llm._torch.pyexecutor import py_executor_creator as creator

    original = creator.create_kv_cache_transceiver
    if getattr(original, "_kvbridge", False):
        return

    def create(mapping, dist, kv_cache_manager, attention_type, cache_transceiver_config, *args, **kwargs):
        if os.environ.get("KVBRIDGE_TRANSCEIVER") != "1" or cache_transceiver_config is None:
            return original(mapping, dist, kv_cache_manager, attention_type, cache_transceiver_config, *args, **kwargs)
        return KVBridgeCacheTransceiver(mapping, dist, kv_cache_manager, attention_type, cache_transceiver_config)

    create._kvbridge = True
    creator.create_kv_cache_transceiver = create
