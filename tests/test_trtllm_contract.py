"""The kvbridge TensorRT-LLM classes against TensorRT-LLM's own base classes.

Where ``import tensorrt_llm`` works, every abstract method of TensorRT-LLM's
``KvCacheConnectorScheduler``, ``KvCacheConnectorWorker`` and ``KvCacheTransceiver`` is
checked against ours (subclassing, ``inspect.signature`` parameter names and kinds),
and the classes must be instantiable (no abstract method left). Elsewhere that test is
skipped with the import error as the reason; the stand-in checks below always run.
"""

from __future__ import annotations

import inspect

import pytest

import kvbridge.adapters.trtllm as trt
from kvbridge.adapters.trtllm import _compat

# The 1.2-era abstract methods (kv_cache_connector.py, kv_cache_transceiver.py), parameter names in order.
SCHEDULER = {
    "build_connector_meta": ["self", "scheduler_output"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "request_finished": ["self", "request", "cache_block_ids"],
    "update_state_after_alloc": ["self", "request", "block_ids"],
}
WORKER = {
    "register_kv_caches": ["self", "kv_cache_tensor"],
    "start_load_kv": ["self", "stream"],
    "wait_for_layer_load": ["self", "layer_idx", "stream"],
    "save_kv_layer": ["self", "layer_idx", "stream"],
    "wait_for_save": ["self", "stream"],
    "get_finished": ["self", "finished_gen_req_ids", "started_loading_req_ids"],
}
TRANSCEIVER = {
    "respond_and_send_async": ["self", "req"],
    "request_and_receive_sync": ["self", "req"],
    "request_and_receive_async": ["self", "req"],
    "check_context_transfer_status": ["self", "at_least_request_num"],
    "check_gen_transfer_status": ["self", "at_least_request_num"],
    "check_gen_transfer_complete": ["self"],
    "cancel_request": ["self", "req"],
    "prepare_context_requests": ["self", "requests"],
    "get_disaggregated_params": ["self"],
}
OURS = [(trt.KVBridgeConnectorScheduler, SCHEDULER), (trt.KVBridgeConnectorWorker, WORKER),
        (trt.KVBridgeCacheTransceiver, TRANSCEIVER)]


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty or p.kind is not inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("cls, methods", OURS, ids=lambda x: getattr(x, "__name__", ""))
def test_methods_match_the_documented_interface(cls, methods):
    """Runs everywhere: every method the executor calls exists with TensorRT-LLM's parameter names."""
    for name, want in methods.items():
        fn = getattr(cls, name, None)
        assert callable(fn), f"{cls.__name__} lacks {name}"
        got = [n for n, _ in _params(fn)]
        assert got == want, f"{cls.__name__}.{name}{got} != TensorRT-LLM's {want}"


def test_constructors_take_what_the_executor_passes():
    """py_executor_creator builds scheduler and worker as cls(llm_args); create_kv_cache_transceiver
    passes (mapping, dist, kv_cache_manager, attention_type, cache_transceiver_config)."""
    for cls in (trt.KVBridgeConnectorScheduler, trt.KVBridgeConnectorWorker):
        assert [n for n, _ in _params(cls.__init__)] == ["self", "llm_args"]
    assert [n for n, _ in _params(trt.KVBridgeCacheTransceiver.__init__)][:6] == [
        "self", "mapping", "dist", "kv_cache_manager", "attention_type", "cache_transceiver_config"]


def test_against_the_real_tensorrt_llm():
    """Where TensorRT-LLM imports: subclassing and every abstract method's signature."""
    if not _compat.TRTLLM_AVAILABLE:
        reason = f"tensorrt_llm is not importable here ({_compat.TRTLLM_IMPORT_ERROR}); contract not checked"
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)
    from tensorrt_llm._torch.pyexecutor import kv_cache_connector as kvc  # pragma: no cover
    from tensorrt_llm._torch.pyexecutor import kv_cache_transceiver as kvt  # pragma: no cover

    pairs = [(trt.KVBridgeConnectorScheduler, kvc.KvCacheConnectorScheduler),  # pragma: no cover
             (trt.KVBridgeConnectorWorker, kvc.KvCacheConnectorWorker),
             (trt.KVBridgeCacheTransceiver, kvt.KvCacheTransceiver)]
    for ours, base in pairs:  # pragma: no cover
        assert issubclass(ours, base), f"{ours.__name__} does not subclass {base.__module__}.{base.__name__}"
        assert not getattr(ours, "__abstractmethods__", set()), f"{ours.__name__} leaves {ours.__abstractmethods__} abstract"
        for name in sorted(getattr(base, "__abstractmethods__", ())):
            theirs, mine = _params(getattr(base, name)), _params(getattr(ours, name))
            assert [n for n, _ in mine] == [n for n, _ in theirs], f"{ours.__name__}.{name}: {mine} != {theirs}"
            assert [k for _, k in mine] == [k for _, k in theirs], f"{ours.__name__}.{name}: parameter kinds differ"
