"""kvbridge's stand-in for TensorRT-LLM 1.2.x: the bindings the connector reads (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.request import LlmRequestState  # noqa: F401
