"""The "TensorRT-LLM side" of the mixed-engine tests lives in the library
(``kvbridge.demo.llama_runner`` and ``kvbridge.demo.trt_engine``); imported from here as before."""

from kvbridge.demo.llama_runner import TinyLlamaRunner, pool_kv  # noqa: F401
from kvbridge.demo.trt_engine import BlockManager, ConnectorManagerState, ExecRequest, TRTEngine  # noqa: F401
