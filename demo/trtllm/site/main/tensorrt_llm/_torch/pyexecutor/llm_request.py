"""kvbridge's stand-in for TensorRT-LLM main: the Python LlmRequest (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.request import PyLlmRequest as LlmRequest  # noqa: F401
