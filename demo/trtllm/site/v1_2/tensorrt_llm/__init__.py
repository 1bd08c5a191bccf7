"""kvbridge's stand-in for TensorRT-LLM 1.2.x: the package (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

__version__ = "1.2.1"
KVBRIDGE_STANDIN = "1.2"
