"""kvbridge's stand-in for TensorRT-LLM 1.2.x: the KV cache connector API at its 1.2 path (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.connector_api import (  # noqa: F401
    KvCacheConnectorManager,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)
