"""kvbridge's stand-in for TensorRT-LLM 1.2.x: internal bindings (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
