"""``KVBridgeCacheTransceiver`` in TensorRT-LLM's disaggregated flow (context-only ->
generation-only), called in py_executor.py's order, prefill and decode in separate
processes over Mooncake TCP, pools of TensorRT-LLM's geometry, every byte checked."""

from __future__ import annotations

import json
import time

from trtllm_driver import TransceiverRank, pool_spec

CFG = dict(host="127.0.0.1", deadline_s=3.0, heartbeat_s=0.2, peer_timeout_s=1.0, quiesce_s=0.5, chunk_bytes=1 << 20)


def test_context_only_to_generation_only_first_token_and_failures():
    t0 = time.monotonic()
    pspec = pool_spec(tpb=32, blocks=24, seed=50)
    pre, dec = TransceiverRank(pspec, CFG), None
    try:
        dec = TransceiverRank(pool_spec(tpb=16, blocks=40, seed=60), CFG)
        ctx = pre.call("context", 7, 100)
        assert ctx["state"] == "DISAGG_CONTEXT_TRANS_IN_PROGRESS" and ctx["first_gen_tokens"] == [50007]
        handle = json.loads(ctx["opaque_state"])  # what the router passes on, inside disaggregated_params
        assert handle["room"] == 7 and handle["endpoints"] == pre.endpoints
        source = {"specs": [pspec], "blocks": pre.call("blocks", 7)}
        assert dec.call("gen", 70, 100, ctx, source)["state"] == "DISAGG_GENERATION_TRANS_IN_PROGRESS"
        out = dec.call("poll_gen", 70, source)
        assert out["state"] == "DISAGG_GENERATION_TRANS_COMPLETE" and out["kv_ok"] and out["tokens"] == [50007], out
        assert out["complete"] and out["free"] == dec.free0
        ctx_done = pre.call("poll_ctx", 1)
        assert ctx_done["done"] == [7] and ctx_done["states"][7] == "DISAGG_CONTEXT_COMPLETE"
        assert ctx_done["free"] == pre.free0

        # a generation request whose prefill is gone errors; a context whose decode never comes errors
        pre.call("context", 8, 40)
        bad = dict(ctx, opaque_state=json.dumps({"kvbridge": 1, "op": "recv", "room": 8,
                                                 "endpoints": ["tcp://127.0.0.1:9"]}).encode())
        dec.call("gen", 80, 40, bad, source)
        out = dec.call("poll_gen", 80, source, timeout=30)
        assert out["state"] == "DISAGG_TRANS_ERROR" and out["free"] == dec.free0, out
        ctx_done = pre.call("poll_ctx", 1, timeout=30)
        assert ctx_done["failed"] == [8] and ctx_done["states"][8] == "DISAGG_TRANS_ERROR"
        assert ctx_done["free"] == pre.free0
    finally:
        for r in (pre, dec):
            if r is not None:
                r.stop()
    print(f"\n[trtllm transceiver] total {time.monotonic() - t0:.1f} s")
