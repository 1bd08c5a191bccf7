"""The TensorRT-LLM versions the stand-in models, and where each difference was read.

"1.2" is the 1.2.x line (PyPI's newest, 1.2.1): the connector API at
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` (read at commit
3277953654b9b2863dae4f1cb81856b172837db4). "main" is current main: the connector API moved
to ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (read at commit
035ab91cad04b7b77a479a9526edecfbc742c661). Executor files (``py_executor.py``,
``py_executor_creator.py``, ``resource_manager.py``, ``llm_request.py``,
``executor/base_worker.py``) were read at versions of each era; ``adapters/trtllm/README.md``
holds the fidelity table that names them fact by fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["EngineVersion", "VERSIONS", "V1_2", "MAIN", "site_dir"]

SITE = Path(__file__).resolve().parent / "site"


@dataclass(frozen=True)
class EngineVersion:
    """What differs between the modelled TensorRT-LLM versions."""

    name: str
    package_version: str
    connector_module: str
    py_disaggregated_params: bool  # the Python LlmRequest carries the request's DisaggregatedParams
    wait_for_initialization: bool  # the executor calls the scheduler's wait_for_initialization() at start-up
    query_commit: bool  # the connector manager splits get_num_new_matched_tokens into query + commit
    context_only_refused_with_overlap: bool  # BaseWorker refuses context_only requests when overlap is on
    refuses_beam_and_host_cache: bool  # PyExecutor refuses a connector with beam > 1 or host_cache_size
    # with block reuse on, a finished request whose KV is still being saved leaves
    # active_requests (``_handle_responses``), so an executor with nothing else to run waits
    # for its next request with no timeout and calls no ``get_finished`` meanwhile
    drops_saving_requests: bool
    site: str  # folder (under site/) holding this version's ``tensorrt_llm`` import tree


V1_2 = EngineVersion(
    name="1.2", package_version="1.2.1", connector_module="tensorrt_llm._torch.pyexecutor.kv_cache_connector",
    py_disaggregated_params=False, wait_for_initialization=False, query_commit=False,
    context_only_refused_with_overlap=True, refuses_beam_and_host_cache=False, drops_saving_requests=True,
    site="v1_2")
MAIN = EngineVersion(
    name="main", package_version="1.3.0rc0", connector_module="tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    py_disaggregated_params=True, wait_for_initialization=True, query_commit=True,
    context_only_refused_with_overlap=False, refuses_beam_and_host_cache=True, drops_saving_requests=False,
    site="main")
VERSIONS = {v.name: v for v in (V1_2, MAIN)}


def site_dir(version: EngineVersion | str) -> Path:
    """The folder to put first on ``sys.path`` so that ``import tensorrt_llm`` finds this
    version's stand-in import tree (the connector API module at its real path)."""
    v = VERSIONS[version] if isinstance(version, str) else version
    return SITE / v.site
