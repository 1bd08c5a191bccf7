"""One rank of a stand-in TensorRT-LLM server: ``python -m kvbridge.demo.trtllm.rank``.

Started by ``StandInServer`` as its own OS process (as an MPI rank is), with the chosen
version's ``tensorrt_llm`` import tree first on ``PYTHONPATH``, so that the plugin under
test finds its base classes where that version has them. It connects back to the parent
(``multiprocessing.connection``), builds its executor, and runs the parent's commands;
every MPI collective of the executor and the connector goes through the parent.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

import torch

from .versions import VERSIONS

__all__ = ["rank_main"]


class _PipeComm:
    """A rank's MPI communicator: collectives go to the parent, which relays them."""

    def __init__(self, conn, rank: int, size: int):
        self.conn, self.rank, self.size = conn, rank, size

    def broadcast(self, obj: Any, root: int) -> Any:
        self.conn.send(("coll", "bcast", root, obj if self.rank == root else None))
        return self.conn.recv()[1]

    def allgather(self, obj: Any) -> list:
        self.conn.send(("coll", "gather", 0, obj))
        return self.conn.recv()[1]


def rank_main(conn, rank: int, world: int, version: str, llm_kw: dict, pool_files: list[str], num_blocks: int,
              setup: tuple | None, kv_scales: list[float] | None = None) -> None:
    """Build this rank's executor and serve the parent's commands until "stop"."""
    torch.set_num_threads(1)  # identical float sums on every rank of a server
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if setup is not None:  # a test's fault-injection hooks: ("module:function", argument)
        import importlib

        mod, fn = setup[0].split(":")
        getattr(importlib.import_module(mod), fn)(setup[1])
    import tensorrt_llm  # the stand-in's import tree (PYTHONPATH), before any plugin imports it

    if getattr(tensorrt_llm, "KVBRIDGE_STANDIN", None) != version:
        raise RuntimeError(f"rank {rank}: tensorrt_llm is {tensorrt_llm.__file__}, not the {version} stand-in")
    from . import dist
    from .executor import DisaggregatedParams, ExecutorRequest, create_py_executor, make_llm_args

    dist.install(_PipeComm(conn, rank, world))
    ex = None
    try:
        llm_args = make_llm_args(**llm_kw)
        ex = create_py_executor(llm_args, version=VERSIONS[version], rank=rank, world=world, pool_files=pool_files,
                                num_blocks=num_blocks, kv_scales=kv_scales)
        mgr = ex.kv_connector_manager
        sched = mgr.scheduler if mgr is not None else None
        worker = mgr.worker if mgr is not None else None
        conn.send(("ready", {
            "bus": getattr(sched, "endpoint", ""), "bootstrap": getattr(sched, "bootstrap_address", ""),
            "sender": getattr(getattr(worker, "sender", None), "endpoint", ""),
            "tokens_per_block": ex.kv_cache_manager.tokens_per_block, "free": ex.kv_cache_manager.free_count,
            "pool_shape": tuple(ex.kv_cache_manager.get_unique_primary_pool().shape),
            "pool_dtype": str(ex.kv_cache_manager.get_unique_primary_pool().dtype)}))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        _close(ex)
        return
    sent: set[int] = set()
    try:
        while True:
            cmd = conn.recv()
            op = cmd[0]
            try:
                if op == "stop":
                    conn.send(("stopped",))
                    return
                if op == "step":
                    ex.iteration()
                    new = {rid: r for rid, r in ex.responses.items() if rid not in sent}
                    sent.update(new)
                    # "generated": output tokens so far of each running request (what trtllm-serve streams)
                    conn.send(("done", {"responses": new, "active": len(ex.active_requests),
                                        "free": ex.kv_cache_manager.free_count,
                                        "generated": {r.request_id: r.get_num_tokens(0) - r.prompt_len
                                                      for r in ex.active_requests}}))
                elif op == "submit":
                    prompt, max_tokens, request_type, salt = cmd[1:]
                    dp = DisaggregatedParams(request_type=request_type) if request_type else None
                    conn.send(("ok", ex.enqueue_request(ExecutorRequest(list(prompt), int(max_tokens), dp, salt))))
                elif op == "cancel":
                    ex.cancel_request(int(cmd[1]))
                    conn.send(("ok", None))
                elif op == "blocks":
                    kvm = ex.kv_cache_manager
                    conn.send(("ok", kvm.get_cache_indices(SimpleRequest(cmd[1])) if kvm.holds(cmd[1]) else None))
                elif op == "state":
                    conn.send(("ok", _state(ex)))
                else:
                    raise ValueError(f"unknown command {op!r}")
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        _close(ex)


class SimpleRequest:
    """A request id where the KV cache manager wants a request."""

    def __init__(self, request_id: int):
        self.request_id = request_id


def _state(ex) -> dict:
    """What a test checks after the fact: blocks, pins, the connector's records."""
    kvm = ex.kv_cache_manager
    mgr = ex.kv_connector_manager
    out = {"free": kvm.free_count, "total": kvm.max_blocks, "pinned": len(kvm._pinned), "held": len(kvm._blocks),
           "ever": sorted(kvm.ever), "active": len(ex.active_requests), "responses": dict(ex.responses),
           "changed_since_freed": kvm.changed_since_freed(), "idle_waits": ex.idle_waits,
           "canceled_req_ids": list(ex.executor_request_queue.canceled_req_ids)}
    if mgr is not None:
        w, s = mgr.worker, mgr.scheduler
        # read by name, no defaults: a renamed attribute fails the test that reads it, never reads 0
        out.update(settings={"deadline_s": w.cfg.deadline_s, "bus_port": w.cfg.bus_port, "secret": bool(w.cfg.secret)},
                   finished_loads=dict(w.finished_loads), finished_saves=dict(w.finished_saves),
                   declined=dict(w.declined), fallbacks=dict(s.fallbacks) if s else {},
                   idle_wakes=s.idle_wake.wakes if s else 0,
                   sender_rooms=len(w.sender._rooms) if w.sender is not None else 0,
                   receiver_rooms=len(w.receiver._rooms) if w.receiver is not None else 0,
                   quarantine=w.receiver.quarantine() if w.receiver is not None else [],
                   layout=w.layout.describe() if w.layout is not None else None,
                   metrics=_metric_samples())
    return out


def _metric_samples() -> dict:
    from prometheus_client import REGISTRY

    get = REGISTRY.get_sample_value
    return {"fallbacks_below_break_even": get("kvbridge_fallbacks_total", {"role": "receiver", "reason": "below_break_even"}),
            "fallbacks_handoff_failed": get("kvbridge_fallbacks_total", {"role": "receiver", "reason": "handoff_failed"}),
            "sender_declined": get("kvbridge_handoffs_total", {"role": "sender", "result": "declined", "plan": "none"})}


def _close(ex) -> None:
    mgr = getattr(ex, "kv_connector_manager", None) if ex is not None else None
    for part in ((mgr.worker, mgr.scheduler) if mgr is not None else ()):
        close = getattr(part, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # pragma: no cover - best effort at shutdown
                pass


def main(argv: list[str]) -> None:
    address, authkey, spec = argv[0], bytes.fromhex(argv[1]), json.loads(argv[2])
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    setup = tuple(spec["setup"]) if spec.get("setup") else None
    rank_main(conn, spec["rank"], spec["world"], spec["version"], spec["llm_kw"], spec["pool_files"],
              spec["num_blocks"], setup, spec.get("kv_scales"))


if __name__ == "__main__":
    main(sys.argv[1:])
    # The executor, its connector and its transport are closed: skip the interpreter's
    # teardown (a second or more of torch's), which every stopping server waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
