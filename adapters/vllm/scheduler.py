"""The scheduler side of the kvbridge vLLM connector (``KVBridgeScheduler``).

vLLM builds the connector with ``KVConnectorRole.SCHEDULER`` once, in the engine core
process, and calls it from ``Scheduler.schedule`` / ``update_from_output`` /
``_free_request``. It reads each request's handle (``kv_transfer_params``), decides what
moves, and turns that into orders for the workers, carried in the connector metadata
vLLM builds every step (``build_connector_meta``) and hands every worker before its
forward (or before ``kv_connector_no_forward`` when nothing is scheduled).

Decode half (``op: recv``): the whole prompt past the local prefix-cache hit is
"matched" and loaded asynchronously (``get_num_new_matched_tokens`` -> ``(n, True)``);
vLLM allocates the blocks, parks the request in ``WAITING_FOR_REMOTE_KVS`` and calls
``update_state_after_alloc`` with them, which orders the load. When the workers report
it in ``finished_recving``, vLLM recomputes only the last prompt token. A failed load
is reported in ``failed_recving`` as well; vLLM's ``kv_load_failure_policy`` then
recomputes the prompt or fails the request.

Prefill half (``op: send``): the room is opened as soon as blocks are allocated (a
decode rank that asks early is accepted); at ``request_finished`` the prompt's blocks
are handed to the workers' senders and kept (``True``: vLLM frees them only when every
worker reports the request in ``finished_sending``, i.e. the room ended), and the
decode half's handle goes back in the response's ``kv_transfer_params``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvbridge.common.orders import Drop, Load, Open, Send

from .config import VllmBridgeConfig
from .handle import Handle, HandleError, handle_of, to_params

__all__ = ["KVBridgeMetadata", "KVBridgeScheduler", "Open", "Send", "Load", "Drop"]

log = logging.getLogger(__name__)


@dataclass
class KVBridgeMetadata:
    """What ``build_connector_meta`` hands every worker for one step: the orders
    (``kvbridge.common.orders``) issued since the previous step, oldest first."""

    orders: list = field(default_factory=list)


class KVBridgeScheduler:
    """The engine core's half of the connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, cfg: VllmBridgeConfig):
        ktc = vllm_config.kv_transfer_config
        self.cfg = cfg
        self.role = str(ktc.kv_role)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._orders: list = []
        self._recv: dict[str, tuple[Handle, int]] = {}  # request -> (decode handle, tokens held locally)
        self._loading: dict[str, int] = {}  # request -> room, load ordered, not reported yet
        self._sending: dict[str, int] = {}  # request -> room, blocks held for its send
        self._opened: dict[str, int] = {}  # request -> room, prefill room opened, request not finished
        self._used: set[str] = set()  # requests whose handle has been acted on (never twice)
        if self.cfg.bootstrap_port < 0 and ktc.is_kv_producer:
            log.warning("kvbridge vLLM: kv_role %s without bootstrap_port: decode servers can reach this prefill "
                        "only through explicit endpoints", self.role)

    # -- what vLLM calls ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode half: every prompt token past the local hit, loaded asynchronously."""
        h = self._handle(request)
        if h is None or h.op != "recv" or request.request_id in self._used:
            return 0, False
        n = len(request.prompt_token_ids or ()) - int(num_computed_tokens)
        if n <= 0:
            return 0, False
        self._recv[request.request_id] = (h, int(num_computed_tokens))
        return n, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode half: order the load into the request's blocks. Prefill half: open its room."""
        rid = request.request_id
        h = self._handle(request)
        if h is None or rid in self._used:
            return
        if h.op == "send":
            if self.role == "kv_consumer":
                log.warning("kvbridge vLLM: request %s: a prefill handle on a kv_consumer server; served as usual", rid)
                return
            self._used.add(rid)
            self._opened[rid] = h.room
            self._orders.append(Open(req=rid, room=h.room))
            return
        got = self._recv.pop(rid, None)
        if got is None or num_external_tokens <= 0:
            return
        if self.role == "kv_producer":
            log.warning("kvbridge vLLM: request %s: a decode handle on a kv_producer server; computed here", rid)
            return
        self._used.add(rid)
        h, start = got
        ids = [int(b) for b in blocks.get_block_ids()[0]]
        stop = start + int(num_external_tokens)
        self._loading[rid] = h.room
        self._orders.append(Load(req=rid, room=h.room, blocks=[int(b) for b in ids], start=start, stop=stop,
                                 bootstrap=h.bootstrap, endpoints=list(h.endpoints)))

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        """This step's orders for every worker."""
        orders, self._orders = self._orders, []
        return KVBridgeMetadata(orders)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' reports of this step: loads and sends that ended."""
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)
        for rid in connector_output.finished_sending or ():
            self._sending.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Prefill half that computed its prompt: send it, keep the blocks, return the
        decode handle. Any half that ended early: end its room."""
        rid = request.request_id
        self._recv.pop(rid, None)
        room = self._opened.pop(rid, None)
        if room is not None:
            prompt_len = int(request.num_prompt_tokens)
            aborted = "ABORT" in str(request.status).upper()
            if aborted or int(request.num_computed_tokens) < prompt_len or not block_ids:
                why = "aborted" if aborted else f"finished after {request.num_computed_tokens} of {prompt_len} tokens"
                self._orders.append(Drop(req=rid, room=room, reason=f"prefill request {why}"))
                self._used.discard(rid)
                return False, None
            out = list(request.output_token_ids or ())
            self._orders.append(Send(req=rid, room=room, blocks=[int(b) for b in block_ids], stop=prompt_len,
                                     first_token=int(out[0]) if out else -1))
            self._sending[rid] = room
            self._used.discard(rid)
            back = Handle("recv", room, bootstrap=self.bootstrap_address) if self.bootstrap_address else None
            return True, (to_params(back) if back else None)
        room = self._loading.get(rid)
        if room is not None:  # aborted while its KV was loading: vLLM holds its blocks until the load reports
            self._orders.append(Drop(req=rid, room=room, reason="decode request aborted while loading"))
        self._used.discard(rid)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a finished prefill's send is in flight (its
        blocks are freed only once a step collects ``finished_sending``)."""
        return bool(self._sending) or bool(self._orders)

    # -- helpers ----------------------------------------------------------------------------
    @property
    def bootstrap_address(self) -> str:
        """``host:port`` of this server's bootstrap server ("" when none)."""
        return f"{self.cfg.host}:{self.cfg.bootstrap_port}" if self.cfg.bootstrap_port > 0 else ""

    def _handle(self, request: Any) -> Handle | None:
        try:
            return handle_of(getattr(request, "kv_transfer_params", None))
        except HandleError as e:
            log.warning("kvbridge vLLM: request %s: %s; served without a handoff", request.request_id, e)
            return None
