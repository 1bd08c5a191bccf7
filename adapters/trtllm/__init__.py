"""TensorRT-LLM KV-connector plugin (kvbridge.adapters.trtllm)."""
