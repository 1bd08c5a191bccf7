"""kvbridge's stand-in for TensorRT-LLM 1.2.x: executor bindings (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

from kvbridge.demo.trtllm.request import ContextPhaseParams  # noqa: F401
