"""kvbridge's stand-in for TensorRT-LLM main: the package (not TensorRT-LLM; see kvbridge.demo.trtllm)."""

__version__ = "1.3.0rc0"
KVBRIDGE_STANDIN = "main"
