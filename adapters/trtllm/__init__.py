"""TensorRT-LLM plugin (kvbridge.adapters.trtllm): a KV cache connector.

``kv_connector_config: {connector_module: kvbridge.adapters.trtllm,
connector_scheduler_class: KVBridgeConnectorScheduler, connector_worker_class:
KVBridgeConnectorWorker}`` in the LLM args enables it. The classes inherit TensorRT-LLM's
own connector bases from whichever module path the installed version has (``_compat``);
a router ties a request to its handoff by announcing the handle under the request's
prompt (``handle.announce``). README.md in this directory is the user documentation.
"""

from ._compat import CONNECTOR_MODULE, TRTLLM_AVAILABLE, TRTLLM_VERSION

# What TensorRT-LLM's LLM args / trtllm-serve YAML take to load this connector.
KV_CONNECTOR_CONFIG = {"connector_module": "kvbridge.adapters.trtllm",
                       "connector_scheduler_class": "KVBridgeConnectorScheduler",
                       "connector_worker_class": "KVBridgeConnectorWorker"}
from .config import BridgeConfig, ConfigError
from .geometry import RankGeometry, pool_layout, pull_plan, rank_geometry
from .handle import AnnounceError, Handle, HandleError, announce, prompt_key
from .scheduler import KVBridgeConnectorMetadata, KVBridgeConnectorScheduler
from .worker import KVBridgeConnectorWorker

__all__ = [
    "CONNECTOR_MODULE",
    "KV_CONNECTOR_CONFIG",
    "TRTLLM_AVAILABLE",
    "TRTLLM_VERSION",
    "AnnounceError",
    "BridgeConfig",
    "ConfigError",
    "Handle",
    "HandleError",
    "KVBridgeConnectorMetadata",
    "KVBridgeConnectorScheduler",
    "KVBridgeConnectorWorker",
    "RankGeometry",
    "announce",
    "pool_layout",
    "prompt_key",
    "pull_plan",
    "rank_geometry",
]
