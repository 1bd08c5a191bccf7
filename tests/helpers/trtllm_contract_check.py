"""The contract between the kvbridge connector and an installed TensorRT-LLM, checked the
way TensorRT-LLM's executor loads it (``py_executor_creator.create_py_executor``): from the
plugin's own ``kv_connector_config``, by import, against the connector API module of the
installed version. Run in-process where the real ``tensorrt_llm`` imports
(tests/trtllm/test_trtllm_contract.py, scripts/gpu_check.sh), and as ``python -m`` against the
stand-in's import trees here.

Checks: the plugin resolved the connector API at the path this version has; the classes
named by the config subclass that module's bases, leave nothing abstract, and take every
abstract method with the base's parameter names and kinds; the constructors take
``llm_args`` alone; that module's ``KvCacheConnectorManager`` accepts the pair (worker on
this rank, scheduler on rank 0), and every hook the executor calls beyond the abstract
ones (main: ``wait_for_initialization``, ``register_kv_cache_layout``, the
``*_by_layer_group`` forms) resolves on the classes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from types import SimpleNamespace

# every hook an executor of either version may call on each class
HOOKS = {
    "scheduler": ["build_connector_meta", "get_num_new_matched_tokens", "request_finished", "update_state_after_alloc"],
    "worker": ["register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
               "get_finished", "bind_connector_meta", "get_connector_meta", "register_forward_pass_callable"],
}
MAIN_HOOKS = {"scheduler": ["wait_for_initialization", "request_finished_by_layer_group",
                            "update_state_after_alloc_by_layer_group"],
              "worker": ["register_kv_cache_layout"]}


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty or p.kind is not inspect.Parameter.KEYWORD_ONLY]


def check_contract(llm_args=None) -> dict:
    """Raise AssertionError naming the first breach; return what was checked."""
    import tensorrt_llm

    from kvbridge.adapters import trtllm as plugin
    from kvbridge.adapters.trtllm import _compat

    version = getattr(tensorrt_llm, "__version__", "?")
    assert plugin.TRTLLM_AVAILABLE, "the plugin did not find TensorRT-LLM"
    api = importlib.import_module(_compat.CONNECTOR_MODULE)
    assert _compat.CONNECTOR_MODULE in _compat.CONNECTOR_PATHS, _compat.CONNECTOR_MODULE
    newest = _compat.CONNECTOR_PATHS[0]
    try:
        importlib.import_module(newest)
        assert _compat.CONNECTOR_MODULE == newest, f"{newest} exists but the plugin took {_compat.CONNECTOR_MODULE}"
    except ModuleNotFoundError:
        pass
    cfg = SimpleNamespace(**plugin.KV_CONNECTOR_CONFIG)
    module = importlib.import_module(cfg.connector_module)  # py_executor_creator: importlib by name
    worker_cls = getattr(module, cfg.connector_worker_class)
    scheduler_cls = getattr(module, cfg.connector_scheduler_class)
    checked = []
    for ours, base, role in ((scheduler_cls, api.KvCacheConnectorScheduler, "scheduler"),
                             (worker_cls, api.KvCacheConnectorWorker, "worker")):
        assert issubclass(ours, base), f"{ours.__name__} does not subclass {base.__module__}.{base.__name__}"
        assert not getattr(ours, "__abstractmethods__", set()), f"{ours.__name__} leaves {ours.__abstractmethods__} abstract"
        for name in sorted(getattr(base, "__abstractmethods__", ())):
            theirs, mine = _params(getattr(base, name)), _params(getattr(ours, name))
            assert mine == theirs, f"{ours.__name__}.{name}{mine} != TensorRT-LLM {version}'s {theirs}"
            checked.append(f"{role}.{name}")
        hooks = HOOKS[role] + (MAIN_HOOKS[role] if hasattr(base, MAIN_HOOKS[role][0]) else [])
        for name in hooks:
            assert callable(getattr(ours, name, None)), f"{ours.__name__} lacks {name}, which the executor calls"
        assert [n for n, _ in _params(ours.__init__)] == ["self", "llm_args"], f"{ours.__name__}.__init__"
    if llm_args is not None:  # build them as the creator does, and the manager around them
        worker = worker_cls(llm_args)
        scheduler = scheduler_cls(llm_args)
        try:
            api.KvCacheConnectorManager(worker, scheduler)
        finally:
            scheduler.close()
            worker.close()
    return {"version": version, "module": _compat.CONNECTOR_MODULE, "checked": checked,
            "main_hooks": hasattr(api.KvCacheConnectorScheduler, "wait_for_initialization")}


if __name__ == "__main__":  # python tests/helpers/trtllm_contract_check.py MODEL_DIR: against whatever tensorrt_llm imports
    args = None
    if len(sys.argv) > 1:
        args = SimpleNamespace(model=sys.argv[1], tensor_parallel_size=1, pipeline_parallel_size=1,
                               kv_cache_config=SimpleNamespace(tokens_per_block=32, enable_block_reuse=True, dtype="auto"))
    print(json.dumps(check_contract(args)))
