"""The TensorRT-LLM plugin: against the stand-in, its contract, layer-wise sends."""
