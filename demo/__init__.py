"""kvbridge.demo: the mixed-engine demo (``kvbridge demo``) and the pieces it runs.

- ``models``: tiny transformers models built offline from configs with seeded weights,
  and transformers' greedy ``generate()`` as the reference.
- ``sglang_server``: SGLang's REAL server on CPU (launcher, health, log tail, kill).
- ``llama_runner``: a tiny Llama forward whose K/V live only in a TensorRT-LLM-geometry pool.
- ``trt_engine``: one TensorRT-LLM rank whose executor stand-in drives the kvbridge
  TensorRT-LLM connector in ``PyExecutor``'s order.
- ``run``: the demo itself (``run_demo``) and its report.

Nothing here is imported by the plugins; ``run_demo`` imports torch, transformers and
requests lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_demo"]


def run_demo(**kw: Any) -> dict:
    """Run the demo; see ``kvbridge.demo.run.run_demo``."""
    from .run import run_demo as _run

    return _run(**kw)
