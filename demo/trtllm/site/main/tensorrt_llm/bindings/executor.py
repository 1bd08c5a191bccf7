"""kvbridge's stand-in for TensorRT-LLM main: executor bindings (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.request import ContextPhaseParams  # noqa: F401
