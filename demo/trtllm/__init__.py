"""A stand-in for TensorRT-LLM's PyTorch executor, built from TensorRT-LLM's source, fact by
fact, for the machines where TensorRT-LLM cannot be installed.

It models what a KV cache connector meets in a real TensorRT-LLM server, per version
(``versions``: the 1.2.x line and main): the module paths of the connector API (a
``tensorrt_llm`` import tree per version under ``site/``), the request objects each hook
receives (``request``: a C++ request copy with only its bound names in
``get_num_new_matched_tokens``, the Python request elsewhere), the connector manager
(``connector_api``), the KV cache manager with device block reuse and its forced
geometry (``kv_cache``), and the executor loop with its refusals and its hook order,
overlap scheduler included (``executor``). Ranks run as separate processes driven in
lockstep (``server.StandInServer``), each computing a tiny model's real forward over its
own primary pool. ``adapters/trtllm/README.md`` maps every modelled behaviour to the
TensorRT-LLM file it comes from.
"""

from .server import StandInError, StandInServer, run_until
from .versions import VERSIONS, site_dir

__all__ = ["StandInError", "StandInServer", "VERSIONS", "run_until", "site_dir"]
