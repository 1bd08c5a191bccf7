"""kvbridge's stand-in for TensorRT-LLM main: the KV cache connector API at its main path (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.connector_api import KvCacheConnectorManagerMain as KvCacheConnectorManager  # noqa: F401
from kvbridge.demo.trtllm.connector_api import KvCacheConnectorSchedulerMain as KvCacheConnectorScheduler  # noqa: F401
from kvbridge.demo.trtllm.connector_api import KvCacheConnectorWorkerMain as KvCacheConnectorWorker  # noqa: F401
from kvbridge.demo.trtllm.connector_api import RequestDataMain as RequestData  # noqa: F401
from kvbridge.demo.trtllm.connector_api import SchedulerOutputMain as SchedulerOutput  # noqa: F401
