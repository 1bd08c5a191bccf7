"""Finding the other engine's prefill without test shortcuts (no SGLang server here):

- ``kvbridge.common.bootstrap``: the SGLang bootstrap protocol a non-SGLang prefill serves
  (topology with the page size it is told to report, each rank's route with its kvbridge
  record, ``/kvbridge/ranks``) and the client a non-SGLang decode uses, with clear errors;
- the TensorRT-LLM plugin: a prefill with ``sglang_bootstrap_port`` publishes its rank
  there; a decode whose handle names only a bootstrap address that answers nothing fails
  the load within ``discovery_timeout_s`` with a reason naming the address, and the
  request is cancelled (``on_failure="fail"``) with its blocks back;
- ``kvbridge demo --json``'s failure shape: one JSON object, ``match`` false, an error.

The positive cross-engine paths (an SGLang server on either side) are
tests/mixed/test_mixed_engines.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import requests

from kvbridge.adapters.trtllm import BridgeConfig, ConfigError, Handle, HandleError
from kvbridge.common.bootstrap import (
    BootstrapError,
    BootstrapServer,
    endpoints_by_tp_rank,
    fetch_ranks,
    parse_address,
)
from tests.helpers.kvhelpers import tiny_record

HTTP = requests.Session()
HTTP.trust_env = False  # never a proxy for 127.0.0.1
ROUTE = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def _record(i: int) -> dict:
    return tiny_record(i, engine="trtllm")


def test_handle_names_an_sglang_bootstrap_address():
    h = Handle("recv", 7, bootstrap="127.0.0.1:8998", on_failure="fail")
    assert Handle.from_dict(h.to_dict()) == h
    assert h.to_dict()["bootstrap"] == "127.0.0.1:8998"
    for bad in ("127.0.0.1", "host:0", "host:99999", ":8998", "a:b:c"):
        with pytest.raises(HandleError, match="host:port"):
            Handle("recv", 7, bootstrap=bad)
    with pytest.raises(HandleError, match="'bootstrap', 'endpoints' or 'prefill'"):
        Handle("recv", 7)
    with pytest.raises(HandleError, match="bootstrap"):
        Handle.from_dict({"op": "recv", "room": 7, "bootstrap": 8998})


def test_one_handle_for_every_plugin_each_reading_what_it_serves():
    """The TensorRT-LLM and vLLM plugins share one Handle; vLLM's request field carries only
    the fields its plugin serves, and a handle naming another is refused by name, both
    ways (never silently dropped: a decode told to find a TensorRT-LLM bus would pull
    nothing)."""
    from kvbridge.adapters.vllm.handle import Handle as VllmHandle, handle_of, to_params
    from kvbridge.common.handles import Handle as Shared

    assert Handle is VllmHandle is Shared
    h = Handle("recv", 9, endpoints=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    assert handle_of(to_params(h)) == h and Handle.from_dict(h.to_dict()) == h
    assert handle_of({"other": 1}) is None
    for extra in ({"prefill": "tcp://127.0.0.1:3"}, {"on_failure": "fail"}):
        with pytest.raises(HandleError, match=f"unknown fields \\['{next(iter(extra))}'\\]"):
            handle_of({"kvbridge": {"op": "recv", "room": 9, "bootstrap": "127.0.0.1:8998", **extra}})
        with pytest.raises(HandleError, match="does not serve handle fields"):
            to_params(Handle("recv", 9, bootstrap="127.0.0.1:8998", **extra))
    with pytest.raises(HandleError, match="a decode handle needs 'bootstrap' or 'endpoints'$"):
        handle_of({"kvbridge": {"op": "recv", "room": 9}})
    with pytest.raises(HandleError, match="must be a mapping"):
        handle_of({"kvbridge": [1]})


def test_config_checks_the_bootstrap_settings():
    assert BridgeConfig().sglang_bootstrap_port == -1  # off unless asked for
    assert BridgeConfig.load(environ={"KVBRIDGE_SGLANG_BOOTSTRAP_PORT": "0", "KVBRIDGE_SGLANG_PAGE_SIZE": "16"}
                             ).sglang_page_size == 16
    with pytest.raises(ConfigError, match="sglang_bootstrap_port"):
        BridgeConfig(sglang_bootstrap_port=70000)
    with pytest.raises(ConfigError, match="sglang_page_size"):
        BridgeConfig(sglang_page_size=0)
    with pytest.raises(ConfigError, match="discovery_timeout_s"):
        BridgeConfig(discovery_timeout_s=0)


def test_bootstrap_server_speaks_sglangs_protocol():
    srv = BootstrapServer("127.0.0.1", 0, page_size=4, tp_size=2)
    try:
        base = f"http://{srv.address}"
        assert HTTP.get(base + "/health", timeout=5).status_code == 200
        assert HTTP.get(base + ROUTE.format(-1, -1, -1, -1), timeout=5).status_code == 503  # ranks missing
        srv.register(0, _record(0))
        with pytest.raises(BootstrapError, match="1 rank\\(s\\) registered, not ready"):
            fetch_ranks(srv.address, timeout_s=0.5)
        srv.register(1, _record(1))
        info = HTTP.get(base + ROUTE.format(-1, -1, -1, -1), timeout=5).json()
        # what SGLang's decode parses strictly (PrefillServerInfo(**data)); page_size is the one told
        assert info["attn_tp_size"] == 2 and info["page_size"] == 4 and info["kv_cache_dtype"] is None
        assert {"attn_cp_size", "dp_size", "pp_size", "follow_bootstrap_room"} <= set(info)
        rank1 = HTTP.get(base + ROUTE.format(0, 0, 1, 0), timeout=5).json()
        assert rank1["rank_ip"] == "127.0.0.1" and rank1["rank_port"] == srv.rank_port
        assert rank1["kvbridge"]["endpoint"] == "tcp://127.0.0.1:40001"
        assert HTTP.get(base + ROUTE.format(0, 0, 2, 0), timeout=5).status_code == 404
        assert HTTP.get(base + "/route?prefill_dp_rank=0", timeout=5).status_code == 400
        body = fetch_ranks(srv.address, timeout_s=5)
        assert endpoints_by_tp_rank(body) == ["tcp://127.0.0.1:40000", "tcp://127.0.0.1:40001"]
        with pytest.raises(ValueError, match="outside TP size"):
            srv.register(2, _record(2))
        with pytest.raises(ValueError, match="endpoint"):
            srv.register(0, {"engine": "trtllm"})
    finally:
        srv.close()
    with pytest.raises(BootstrapError, match=f"{srv.address}.*within 0.3 s.*(refused|Errno)"):
        fetch_ranks(srv.address, timeout_s=0.3)


def test_discovery_client_errors_name_the_problem():
    with pytest.raises(ValueError, match="host:port"):
        parse_address("localhost")
    body = {"dp_size": 2, "attn_cp_size": 1, "pp_size": 1, "attn_tp_size": 1, "ranks": []}
    with pytest.raises(BootstrapError, match="dp_size 2"):
        endpoints_by_tp_rank(body, "h:1")
    body = {"dp_size": 1, "attn_cp_size": 1, "pp_size": 1, "attn_tp_size": 2,
            "ranks": [{"tp_rank": 0, "endpoint": "tcp://a:1"}]}
    with pytest.raises(BootstrapError, match=r"TP rank\(s\) \[1\]"):
        endpoints_by_tp_rank(body, "h:1")
    for bad, what in [({"attn_tp_size": 10**12}, "over the 4096 ranks"), ({"attn_tp_size": "x"}, "not an integer"),
                      ({"dp_size": [1]}, "not an integer"), ({"ranks": [{"tp_rank": "r", "endpoint": "tcp://a:1"}]},
                                                            "not an integer")]:
        with pytest.raises(BootstrapError, match=what):
            endpoints_by_tp_rank({**body, **bad}, "h:1")


def test_a_hostile_bootstrap_answer_is_refused_by_name(monkeypatch):
    """A bootstrap server (or whoever answers in its place) sending JSON nested past the
    parser's depth, or an answer larger than a reader takes: named, never a crash."""
    import http.server
    import threading

    import kvbridge.common.bootstrap as B

    monkeypatch.setattr(B, "_MAX_ANSWER", 1 << 16)
    answers = iter([b"[" * 5_000 + b"]" * 5_000, b"[" + b" " * (1 << 17) + b"]"])

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(answers, b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(BootstrapError, match="nested past the parser's depth"):
            fetch_ranks(address, timeout_s=0.1)
        with pytest.raises(BootstrapError, match="larger than 65536 bytes"):
            fetch_ranks(address, timeout_s=0.1)
    finally:
        srv.shutdown()


def test_trt_prefill_publishes_its_ranks_for_sglang_decodes(tiny_llama_dir):
    from kvbridge.demo.trtllm import StandInServer

    with StandInServer("1.2", tiny_llama_dir, tokens_per_block=32, num_blocks=8,
                       plugin={"sglang_bootstrap_port": 0, "sglang_page_size": 8}) as trt:
        addr = trt.bootstrap_address
        body = fetch_ranks(addr, timeout_s=10)  # registered once the worker said hello on the bus
        assert endpoints_by_tp_rank(body, addr) == trt.sender_endpoints
        (rank,) = body["ranks"]
        st = trt.state()
        assert rank["engine"] == "trtllm" and rank["page_size"] == 32  # its real block size
        assert rank["layout"] == st["layout"]
        info = HTTP.get(f"http://{addr}" + ROUTE.format(-1, -1, -1, -1), timeout=5).json()
        assert info["page_size"] == 8  # what SGLang's decode compares with its own --page-size
    with pytest.raises(BootstrapError):
        fetch_ranks(addr, timeout_s=0.3)  # closed with the connector


def test_trt_decode_fails_clearly_when_the_bootstrap_address_answers_nothing(tiny_llama_dir):
    from kvbridge.adapters.trtllm import announce
    from kvbridge.demo.models import random_prompt
    from kvbridge.demo.trtllm import StandInServer, run_until

    with StandInServer("main", tiny_llama_dir, tokens_per_block=32, num_blocks=8,
                       plugin={"discovery_timeout_s": 1.0}) as trt:
        addr = f"127.0.0.1:{_dead_port()}"
        prompt = random_prompt(40, seed=1)
        announce(trt.bus, prompt, Handle("recv", 5, bootstrap=addr, on_failure="fail"))
        t0 = time.monotonic()
        rid = trt.submit(prompt, 4)
        run_until([trt], lambda: rid in trt.responses and trt.drained(), 30)
        assert time.monotonic() - t0 < 15
        done = trt.state()["finished_loads"][rid]
        assert not done["ok"] and done["verdict"] == "fail", done
        assert addr in done["reason"] and "refused" in done["reason"].lower(), done["reason"]
        assert trt.responses[rid]["finish_reason"] == "cancelled"  # the executor cancelled the request
        st = trt.state()
        assert st["free"] == st["total"] and st["held"] == 0


def test_demo_json_failure_is_one_json_object(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "demo", "--json", "--model-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    (line,) = out.stdout.strip().splitlines()
    res = json.loads(line)
    assert res["match"] is False and "config.json" in res["error"]
