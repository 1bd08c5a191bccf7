"""One request through a handoff with a REAL vLLM server on one side (or both), the router's part.

Each ``*_handoff`` function takes servers that are already running (the demo starts
them, the tests share them), sends one prompt's two halves the way a router would, and
returns what happened: the decode's generated ids, the first token the prefill sampled,
and each side's kvbridge record of the handoff. Nothing is checked here: the caller
compares against transformers' ``generate()``.

- vLLM -> vLLM: the prefill half carries ``{"kvbridge": {"op": "send", "room": R}}``; its
  response's ``kv_transfer_params`` is the decode half's handle (the prefill's bootstrap
  address), passed on unchanged.
- SGLang -> vLLM: SGLang's prefill gets the request with ``bootstrap_room`` R; the vLLM
  decode's handle names SGLang's bootstrap server, which lists the kvbridge ranks.
- vLLM -> SGLang: the vLLM prefill's bootstrap server speaks SGLang's protocol; SGLang's
  decode gets ``bootstrap_host/port`` of it and ``bootstrap_room`` R.
- vLLM <-> TensorRT-LLM (stand-in): the router announces the TensorRT-LLM half's handle
  under the prompt (``kvbridge.adapters.trtllm.announce``) before submitting it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from kvbridge.adapters.vllm.handle import Handle, to_params

from .sglang_server import HOST, ServerError, generate_body, generate_output, new_room, post_json
from .vllm_server import VllmServer, complete

__all__ = ["handoff", "FLOWS"]


def _wait_record(srv: VllmServer, room: int, side: str, timeout: float = 30.0) -> dict:
    """The vLLM side's record of ``room`` (workers append it when the handoff ends)."""
    end = time.monotonic() + timeout
    while True:
        rec = srv.record_of(room, side)
        if rec is not None:
            return rec
        if time.monotonic() > end:
            raise ServerError(f"vLLM {srv.role}: no {side} record of room {room} within {timeout:.0f} s\n"
                              f"--- {srv.log_path} ---\n{srv.log_tail(40)}")
        time.sleep(0.05)


def _external_tokens(srv: VllmServer) -> float:
    return srv.metric('vllm:prompt_tokens_by_source_total{engine="0",model_name="' + str(srv.model_dir)
                      + '",source="external_kv_transfer"}')


def vllm_to_vllm(prefill: VllmServer, decode: VllmServer, prompt: Sequence[int], max_new: int) -> dict:
    room = new_room()
    ext0 = _external_tokens(decode)
    p = complete(prefill, prompt, 1, to_params(Handle("send", room)))
    d = complete(decode, prompt, max_new, p["kv_transfer_params"])
    return {"room": room, "generated": d["token_ids"], "first_prefill": p["token_ids"][0],
            "decode_handle": p["kv_transfer_params"], "external_tokens": _external_tokens(decode) - ext0,
            "send": _wait_record(prefill, room, "send"), "load": _wait_record(decode, room, "load")}


def sglang_to_vllm(prefill: Any, bootstrap_port: int, decode: VllmServer, prompt: Sequence[int], max_new: int) -> dict:
    """``prefill``: an SGLang prefill ``Server`` on the kvbridge backend whose bootstrap
    server listens on ``bootstrap_port``."""
    room = new_room()
    ext0 = _external_tokens(decode)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post_json, prefill.url + "/generate", generate_body(prompt, 1, bootstrap_port, room), 120)
        d = complete(decode, prompt, max_new, to_params(Handle("recv", room, bootstrap=f"{HOST}:{bootstrap_port}")))
        out = generate_output(fut.result(), prefill, "SGLang prefill")
    return {"room": room, "generated": d["token_ids"], "first_prefill": int(out["output_ids"][0]),
            "external_tokens": _external_tokens(decode) - ext0, "load": _wait_record(decode, room, "load")}


def vllm_to_sglang(prefill: VllmServer, decode: Any, prompt: Sequence[int], max_new: int) -> dict:
    """``decode``: an SGLang decode ``Server`` on the kvbridge backend (page size = the vLLM
    prefill's ``sglang_page_size``)."""
    room = new_room()
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post_json, decode.url + "/generate", generate_body(prompt, max_new, prefill.bootstrap_port, room), 120)
        p = complete(prefill, prompt, 1, to_params(Handle("send", room)))
        out = generate_output(fut.result(), decode, "SGLang decode")
    return {"room": room, "generated": [int(t) for t in out["output_ids"]], "first_prefill": p["token_ids"][0],
            "send": _wait_record(prefill, room, "send")}


def vllm_to_trtllm(prefill: VllmServer, trt: Any, prompt: Sequence[int], max_new: int) -> dict:
    """``trt``: a ``kvbridge.demo.trtllm.StandInServer`` (decode)."""
    from kvbridge.adapters.trtllm import announce

    from .trtllm import run_until

    room = new_room()
    announce(trt.bus, prompt, Handle("recv", room, bootstrap=prefill.bootstrap_address, on_failure="fail"))
    rid = trt.submit(prompt, max_new)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, prefill, prompt, 1, to_params(Handle("send", room)))
        run_until([trt], lambda: rid in trt.responses and trt.drained(), 120, pause_s=0.001)
        p = fut.result()
    done = trt.state()["finished_loads"].get(rid) or {}
    resp = trt.responses[rid]
    return {"room": room, "generated": list(resp["output_token_ids"]), "first_prefill": p["token_ids"][0],
            "trt_load": done, "context_tokens_computed": resp["context_tokens_computed"],
            "send": _wait_record(prefill, room, "send")}


def trtllm_to_vllm(trt: Any, decode: VllmServer, prompt: Sequence[int], max_new: int) -> dict:
    """``trt``: a StandInServer (prefill) whose connector runs an SGLang-compatible
    bootstrap server (``sglang_bootstrap_port``)."""
    from kvbridge.adapters.trtllm import announce

    from .trtllm import run_until

    room = new_room()
    ext0 = _external_tokens(decode)
    announce(trt.bus, prompt, Handle("send", room))
    rid = trt.submit(prompt, 1)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, decode, prompt, max_new,
                        to_params(Handle("recv", room, bootstrap=trt.bootstrap_address)))
        run_until([trt], lambda: rid in trt.responses and trt.drained() and fut.done(), 120, pause_s=0.001)
        d = fut.result()
    saved = trt.state()["finished_saves"].get(rid) or {}
    return {"room": room, "generated": d["token_ids"], "first_prefill": int(trt.responses[rid]["output_token_ids"][0]),
            "trt_save": saved, "external_tokens": _external_tokens(decode) - ext0,
            "load": _wait_record(decode, room, "load")}


FLOWS = {("vllm", "vllm"): vllm_to_vllm, ("sglang", "vllm"): sglang_to_vllm, ("vllm", "sglang"): vllm_to_sglang,
         ("vllm", "trtllm"): vllm_to_trtllm, ("trtllm", "vllm"): trtllm_to_vllm}


def handoff(prefill_engine: str, decode_engine: str, *args, **kw) -> dict:
    """Run the flow of (``prefill_engine``, ``decode_engine``)."""
    return FLOWS[(prefill_engine, decode_engine)](*args, **kw)
