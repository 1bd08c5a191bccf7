"""The stand-in's model: the demo's tiny-model runners, chosen by the model's config."""

from __future__ import annotations

from functools import lru_cache

__all__ = ["load_runner"]


@lru_cache(maxsize=4)
def load_runner(model_dir: str):
    """``TinyMLARunner`` for a DeepSeek-style MLA model, ``TinyLlamaRunner`` otherwise."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("kv_lora_rank"):
        from ..mla_runner import TinyMLARunner

        return TinyMLARunner(model_dir)
    from ..llama_runner import TinyLlamaRunner

    return TinyLlamaRunner(model_dir)
