"""kvbridge's stand-in for TensorRT-LLM 1.2.x: batch-manager bindings (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.request import CppLlmRequest as LlmRequest  # noqa: F401
from kvbridge.demo.trtllm.request import LlmRequestType  # noqa: F401
