"""SGLang transfer-backend plugin (kvbridge.adapters.sglang)."""
