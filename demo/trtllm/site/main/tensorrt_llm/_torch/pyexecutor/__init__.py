"""kvbridge's stand-in for TensorRT-LLM main: the PyTorch executor (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
