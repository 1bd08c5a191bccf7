"""TensorRT-LLM plugin (kvbridge.adapters.trtllm).

``kv_connector_config: {connector_module: kvbridge.adapters.trtllm,
connector_scheduler_class: KVBridgeConnectorScheduler, connector_worker_class:
KVBridgeConnectorWorker}`` enables the KV connector; ``KVBridgeCacheTransceiver`` is the
same handoff as a cache transceiver. TensorRT-LLM is imported only if installed (see
``_compat``); requests name their handoff with a handle (see ``handle``). README.md in
this directory is the user documentation.
"""

from ._compat import TRTLLM_AVAILABLE, TRTLLM_IMPORT_ERROR
from .config import BridgeConfig, ConfigError
from .connector import KVBridgeConnectorMetadata, KVBridgeConnectorScheduler, KVBridgeConnectorWorker
from .geometry import RankGeometry, layout_from_kv_cache_manager, pool_layout, pull_plan
from .handle import Handle, HandleError, decode_params, encode_handle, handle_of, prefill_params
from .transceiver import KVBridgeCacheTransceiver

__all__ = [
    "TRTLLM_AVAILABLE",
    "TRTLLM_IMPORT_ERROR",
    "BridgeConfig",
    "ConfigError",
    "Handle",
    "HandleError",
    "KVBridgeCacheTransceiver",
    "KVBridgeConnectorMetadata",
    "KVBridgeConnectorScheduler",
    "KVBridgeConnectorWorker",
    "RankGeometry",
    "decode_params",
    "encode_handle",
    "handle_of",
    "layout_from_kv_cache_manager",
    "pool_layout",
    "prefill_params",
    "pull_plan",
]
