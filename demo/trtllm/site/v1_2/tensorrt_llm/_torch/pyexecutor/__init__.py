"""kvbridge's stand-in for TensorRT-LLM 1.2.x: the PyTorch executor (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
