"""kvbridge.demo: the mixed-engine demo (``kvbridge demo``) and the pieces it runs.

- ``models``: tiny transformers models built offline from configs with seeded weights,
  and transformers' greedy ``generate()`` as the reference.
- ``sglang_server``: SGLang's REAL server on CPU (launcher, health, log tail, kill).
- ``llama_runner`` / ``mla_runner``: tiny Llama and DeepSeek-MLA forwards whose KV live only
  in TensorRT-LLM-geometry pools (the stand-in's model).
- ``trtllm``: a stand-in for TensorRT-LLM's PyTorch executor (1.2.x and main), built from
  TensorRT-LLM's source fact by fact, that loads and drives the kvbridge connector as the
  real executor does, one process per rank.
- ``run``: the demo itself (``run_demo``) and its report.
- ``route_local``: a mixed deployment of real servers on this machine with ``kvbridge
  route`` in front (the router's demo, ``kvbridge.bench.route``, tests).
- ``route_demo``: ``kvbridge demo --router``, that deployment driven by the ``openai``
  client, checked.

Nothing here is imported by the plugins or the router; ``run_demo`` imports torch,
transformers and requests lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_demo"]


def run_demo(**kw: Any) -> dict:
    """Run the demo; see ``kvbridge.demo.run.run_demo``."""
    from .run import run_demo as _run

    return _run(**kw)
