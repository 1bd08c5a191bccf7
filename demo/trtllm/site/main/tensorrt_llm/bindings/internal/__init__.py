"""kvbridge's stand-in for TensorRT-LLM main: internal bindings (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
