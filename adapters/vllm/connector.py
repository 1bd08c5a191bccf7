"""``KVBridgeConnector``: kvbridge as an out-of-tree vLLM KV connector (``KVConnectorBase_V1``).

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector": "KVBridgeConnector",
"kv_connector_module_path": "kvbridge.adapters.vllm.connector", "kv_role":
"kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'``
(``KVConnectorFactory.get_connector_class``); vLLM builds one per process with its role:
``SCHEDULER`` in the engine core (``scheduler.KVBridgeScheduler``), ``WORKER`` in every
worker (``worker.KVBridgeWorker``). Each method below says who calls it and when.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import VllmBridgeConfig
from .scheduler import KVBridgeMetadata, KVBridgeScheduler
from .worker import KVBridgeWorker

__all__ = ["KVBridgeConnector", "KVBridgeConnectorMetadata"]

log = logging.getLogger(__name__)


class KVBridgeConnectorMetadata(KVBridgeMetadata, KVConnectorMetadata):
    """The orders of one step, scheduler -> every worker (``KVBridgeMetadata``)."""


class KVBridgeConnector(KVConnectorBase_V1):
    """kvbridge's vLLM connector: moves a request's KV to or from a server of any engine
    that speaks kvbridge's protocol (vLLM, SGLang, TensorRT-LLM), handles in
    ``kv_transfer_params`` (``handle``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        cfg = VllmBridgeConfig.load(getattr(ktc, "kv_connector_extra_config", None) or {})
        self.bridge_scheduler: KVBridgeScheduler | None = None
        self.bridge_worker: KVBridgeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.bridge_scheduler = KVBridgeScheduler(vllm_config, cfg)
        else:
            self.bridge_worker = KVBridgeWorker(vllm_config, cfg)

    # -- worker side (every worker process) ----------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Called once by the model runner after the KV cache is allocated, with each
        attention layer's cache (CPU backend: ``[num_blocks, num_kv_heads, block_size,
        2 * head_size]``, K transposed inside a (block, head)): describe and register it,
        start the sender / receiver."""
        self.bridge_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Called every step by the model runner's connector context (before the forward
        when the step has synchronous loads, after it otherwise), metadata bound: apply the
        scheduler's orders. Loads run asynchronously on kvbridge's threads."""
        self.bridge_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by each attention layer before it reads its cache: nothing to wait for,
        a loading request is not scheduled until its whole load has landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Called by each attention layer after it wrote its cache: nothing per layer, a
        prompt's KV is sent once its request finished (``request_finished``)."""

    def wait_for_save(self):
        """Called at the end of every step: nothing to wait for; sends are asynchronous and
        their blocks stay held until ``get_transfer_results`` reports them."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Called every step after the forward (and on steps without one), with the
        requests finished since the last step: sends whose room ended (vLLM frees their
        blocks), loads whose blocks no sender can still write (failed ones listed in
        ``failed_recving`` too: vLLM's ``kv_load_failure_policy`` recomputes or fails them)."""
        sent, loaded, failed = self.bridge_worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=loaded, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Older entry point of the same report: (finished sending, finished receiving)."""
        sent, loaded, _ = self.bridge_worker.get_transfer_results(finished_req_ids)
        return sent or None, loaded or None

    def shutdown(self):
        """Called when the worker shuts down: stop kvbridge's threads, sockets and transport."""
        if self.bridge_worker is not None:
            self.bridge_worker.close()

    # -- scheduler side (engine core) ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called by ``Scheduler.schedule`` for a waiting request with nothing computed yet,
        after the local prefix-cache lookup: a decode half loads every prompt token past
        ``num_computed_tokens``, asynchronously."""
        return self.bridge_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        """Called by ``Scheduler.schedule`` right after it allocated a request's blocks:
        a decode half's load is ordered into them; a prefill half's room is opened."""
        self.bridge_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Called at the end of every ``Scheduler.schedule``: this step's orders."""
        meta = self.bridge_scheduler.build_connector_meta(scheduler_output)
        return KVBridgeConnectorMetadata(meta.orders)

    def update_connector_output(self, connector_output: Any):
        """Called by ``Scheduler.update_from_output`` with the workers' aggregated report."""
        self.bridge_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once by ``Scheduler._free_request`` when a request finished, before its
        blocks are freed: a prefill half that computed its prompt sends it and keeps the
        blocks (True) until its room ends; its response carries the decode half's handle."""
        return self.bridge_scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Asked by ``Scheduler.has_requests``: keep stepping while a send holds blocks."""
        return self.bridge_scheduler.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """KV cache groups a load restores: every transfer group (the request's own blocks)."""
        return tuple(getattr(self._kv_cache_config, "transfer_group_ids", ()) or (0,))
