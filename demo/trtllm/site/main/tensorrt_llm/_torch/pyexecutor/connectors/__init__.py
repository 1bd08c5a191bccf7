"""kvbridge's stand-in for TensorRT-LLM main: the connectors package (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
