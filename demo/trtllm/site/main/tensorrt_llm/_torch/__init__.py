"""kvbridge's stand-in for TensorRT-LLM main: the PyTorch backend (not TensorRT-LLM; see kvbridge.demo.trtllm)."""
