"""The TensorRT-LLM stand-in refuses what TensorRT-LLM refuses (kvbridge.demo.trtllm; each
fact's source is in adapters/trtllm/README.md), and the plugin works under it.

A plugin is only as true as the stand-in it is tested against: these tests pin down the
facts a test driver can get wrong, each of which would hide a defect of the plugin in a real
TensorRT-LLM: the C++ request copy ``get_num_new_matched_tokens`` receives,
1.2's Python request without ``py_disaggregated_params``, main's connector module path and
its ``wait_for_initialization``, the executor's refusals, block reuse as the only path to
the connector, and the geometry the executor forces.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.demo.models import random_prompt
from kvbridge.demo.trtllm import StandInError, site_dir
from kvbridge.demo.trtllm.request import ContextPhaseParams, CppLlmRequest, LlmRequestType, PyLlmRequest, cpp_copy
from kvbridge.demo.trtllm.versions import MAIN, V1_2
from tests.helpers.trtllm_servers import wait_done


def _py(version, **kw):
    return PyLlmRequest(version=version, request_id=5, input_tokens=[3, 4, 5], max_new_tokens=2, **kw)


def test_the_cpp_copy_exposes_only_bound_names():
    req = _py(MAIN, disaggregated_params=object(), cache_salt="s")
    copy = cpp_copy(req)
    assert type(copy) is CppLlmRequest and copy is not req
    assert (copy.request_id, copy.prompt_len, copy.get_tokens(0)) == (5, 3, [3, 4, 5])
    for name in ("py_disaggregated_params", "py_request_id", "cache_salt", "is_generation_only_request_"):
        assert not hasattr(copy, name), name
    copy.py_note = 1  # nb::dynamic_attr: settable, but only on the copy
    assert not hasattr(req, "py_note")
    for ro in ("context_phase_params", "is_generation_only_request", "prepopulated_prompt_len", "cache_salt_id",
               "context_remaining_length", "llm_request_type", "orig_prompt_len"):
        with pytest.raises(AttributeError):
            setattr(copy, ro, None)
    copy.context_current_position = 2  # read-write binding; the live request is unaffected
    assert req.context_current_position == 0
    # a property on the C++ object, a method on the Python one (always truthy unless called)
    assert copy.is_generation_only_request is False
    assert callable(req.is_generation_only_request) and req.is_generation_only_request() is False
    with pytest.raises(AttributeError):
        ContextPhaseParams([1], 2, b"x").opaque_state = b"y"


def test_python_request_per_version():
    """1.2's Python request has no ``py_disaggregated_params``; main's has it."""
    assert not hasattr(_py(V1_2, disaggregated_params=object()), "py_disaggregated_params")
    assert _py(MAIN, disaggregated_params="p").py_disaggregated_params == "p"


def test_connector_manager_refuses_generation_only_requests():
    from kvbridge.demo.trtllm.connector_api import KvCacheConnectorManager

    class Sched:
        def get_num_new_matched_tokens(self, request, n):
            return 0, True

    mgr = KvCacheConnectorManager(worker=object(), scheduler=Sched())
    gen = cpp_copy(_py(V1_2, llm_request_type=LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY))
    with pytest.raises(RuntimeError, match="not supported for generation-only"):
        mgr.get_num_new_matched_tokens(gen, 0)
    with pytest.raises(RuntimeError, match="load_kv_async must be False"):
        mgr.get_num_new_matched_tokens(cpp_copy(_py(V1_2)), 0)


@pytest.mark.parametrize("version", ["1.2", "main"])
def test_executor_refusals(trt_servers, tiny_llama_dir, version):
    """No capacity policy but GUARANTEED_NO_EVICT with a connector; context-only and
    generation-only requests need a cache transceiver (the connector is not one)."""
    with pytest.raises(StandInError, match="only supported with guaranteed no evict"):
        trt_servers(version, tiny_llama_dir, capacity_scheduler_policy="MAX_UTILIZATION", num_blocks=8)
    with pytest.raises(StandInError, match="not supported with pipeline parallelism"):
        trt_servers(version, tiny_llama_dir, pipeline_parallel_size=2, num_blocks=8)
    s = trt_servers(version, tiny_llama_dir, num_blocks=8)
    for rt in ("context_only", "generation_only"):
        with pytest.raises(StandInError, match="kv_cache_transceiver is disabled"):
            s.submit([5, 6, 7], 1, request_type=rt)
    s.submit([5, 6, 7], 1, request_type="context_and_generation")  # accepted


@pytest.mark.parametrize("version,base_module", [
    ("1.2", "tensorrt_llm._torch.pyexecutor.kv_cache_connector"),
    ("main", "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector")])
def test_plugin_inherits_the_bases_at_the_versions_path(version, base_module):
    """main has only the new module path: the plugin must inherit its bases (with
    ``wait_for_initialization``, which main's executor calls at start-up)."""
    code = ("import importlib, kvbridge.adapters.trtllm as p; api = importlib.import_module(%r); "
            "assert p.CONNECTOR_MODULE == %r, p.CONNECTOR_MODULE; "
            "assert issubclass(p.KVBridgeConnectorScheduler, api.KvCacheConnectorScheduler); "
            "assert issubclass(p.KVBridgeConnectorWorker, api.KvCacheConnectorWorker); "
            "print(hasattr(p.KVBridgeConnectorScheduler, 'wait_for_initialization'))" % (base_module, base_module))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir(version))] + sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(version == "main")


def test_no_transceiver_variant():
    """There is no cache-transceiver variant: TensorRT-LLM has no registry for an
    out-of-tree transceiver, its executor looks ``create_kv_cache_transceiver`` up by the
    name it imported into ``_util``, and ``context_phase_params`` is read-only; adapters/trtllm/README.md
    says so."""
    import importlib.util
    from pathlib import Path

    import kvbridge.adapters.trtllm as p

    assert importlib.util.find_spec("kvbridge.adapters.trtllm.transceiver") is None
    assert not any("Transceiver" in name for name in dir(p))
    readme = (Path(p.__file__).parent / "README.md").read_text()
    assert "no cache transceiver" in readme.lower()


def test_a_stranger_on_the_rank_port_does_not_end_the_start():
    """A connection that reaches a rank's listener first and fails the handshake (another
    process on the host reconnecting to a port the OS handed out again) is dropped; the
    rank's own connection, queued behind it, is the one returned."""
    import secrets
    import socket
    import struct
    from multiprocessing.connection import Listener

    from kvbridge.demo.trtllm.server import _accept

    authkey = secrets.token_bytes(16)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        host, port = listener.address
        stranger = socket.create_connection((host, port))
        stranger.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")  # a ZMTP greeting
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stranger.close()  # reset, before the rank is even started
        code = ("import sys, time; from multiprocessing.connection import Client; "
                f"c = Client(({host!r}, {port}), authkey=bytes.fromhex({authkey.hex()!r})); "
                "c.send('rank'); time.sleep(60)")
        rank = subprocess.Popen([sys.executable, "-c", code])
        try:
            conn = _accept(listener, rank, 60.0)
            assert conn.poll(30) and conn.recv() == "rank"
        finally:
            rank.kill()
            rank.wait(5)
