"""One SGLang server (prefill OR decode) on the kvbridge backend, for the mixed-engine
tests: the other half of the pair is the "TensorRT-LLM" side in this process, so only
one SGLang server runs (this machine has 2 cores). Built from tests/sglang_servers.py's
pieces (argv, environment, ports, process-group kill)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import requests

import sglang_servers as S

BACKEND = "kvbridge"
ENV = {"SGLANG_PLUGINS": "kvbridge"}


@contextlib.contextmanager
def sglang_server(model_dir, role: str, *, timeout: float = S.DEFAULT_START_TIMEOUT, log_dir=None,
                  extra_args=()):
    """Start ``role`` ("prefill" | "decode") and yield (server, bootstrap_port); killed on exit.
    The bootstrap port is the prefill's own bootstrap server (decode: unused)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvbridge-mixed-{role}-"))
    port, nccl, boot = S.free_ports(3)
    env, delta = S._server_env(BACKEND, ENV)
    argv = S._server_argv(sys.executable, Path(model_dir).resolve(), role, BACKEND, port, nccl, boot, 1,
                          S.DEFAULT_MAX_TOTAL_TOKENS, list(extra_args))
    srv = S.Server(role=role, port=port, argv=argv, env_delta=delta, log_path=log_dir / f"{role}.log")
    srv.start(env)
    try:
        deadline = time.monotonic() + timeout
        while not srv.health(timeout=2.0):
            fatal = S._fatal_line(srv)
            if fatal or not srv.alive() or time.monotonic() > deadline:
                time.sleep(1.0)
                raise S.ServerError(f"{role} server did not come up ({fatal or 'dead or timed out'}):\n"
                                    f"{srv.command_line()}\n{srv.log_tail(60)}")
            time.sleep(0.5)
        srv.ready_after_s = time.monotonic() - srv.started_at
        yield srv, boot
    finally:
        srv.kill()


def kvbridge_ranks(bootstrap_port: int, timeout: float = 60.0) -> dict:
    """The prefill's kvbridge ranks from its SGLang bootstrap server (GET /kvbridge/ranks),
    once every rank registered."""
    url = f"http://{S.HOST}:{bootstrap_port}/kvbridge/ranks"
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        try:
            r = requests.get(url, timeout=5, proxies={"http": None, "https": None})
            last = r.status_code, r.text[:500]
            if r.status_code == 200:
                body = r.json()
                if body.get("ready") and body.get("ranks"):
                    return body
        except requests.RequestException as e:
            last = repr(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url}: no ready kvbridge ranks: {last}")


class TRTPrefillBootstrap:
    """An SGLang bootstrap server for a "TensorRT-LLM" prefill, so that an SGLang decode
    server on the kvbridge backend can find it: SGLang's decode resolves prefill ranks only
    through a bootstrap server (GET /route), and the TensorRT-LLM adapter publishes none.
    Runs kvbridge's own ``KVBridgeKVBootstrapServer`` in this process and registers one
    rank (TP 1) with the TensorRT-LLM worker's kvbridge record, as an SGLang prefill rank's
    registration would. ``rank_port`` is a bound ZMQ PULL socket that swallows the
    decode's SGLang registration frames (kvbridge needs none of them).

    ``page_size`` must be the DECODE's: SGLang's decode refuses a prefill whose registered
    page size differs (``try_ensure_parallel_info``), although kvbridge converts block sizes.
    """

    def __init__(self, worker, *, page_size: int = 1):
        import zmq

        from kvbridge.adapters.sglang.conn import KVBridgeKVBootstrapServer
        from kvbridge.common import protocol as P

        self.port = S.free_port()
        self.server = KVBridgeKVBootstrapServer(S.HOST, self.port)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        rank_port = self._pull.bind_to_random_port(f"tcp://{S.HOST}")
        row = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
               "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
               "rank_ip": S.HOST, "rank_port": rank_port, "page_size": page_size, "kv_cache_dtype": None,
               "kvbridge": {"version": P.PROTOCOL_VERSION, "endpoint": worker.sender.endpoint,
                            "session": worker.transport.session_id, "engine": "trtllm",
                            "page_size": worker.layout.tokens_per_block, "layout": worker.layout.describe()}}
        url = f"http://{S.HOST}:{self.port}/route"
        end = time.monotonic() + 30
        while True:
            try:
                r = requests.put(url, json=row, timeout=5, proxies={"http": None, "https": None})
                if r.status_code == 200:
                    break
                raise RuntimeError(f"bootstrap registration refused: {r.status_code} {r.text[:300]}")
            except requests.ConnectionError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def close(self):
        self._pull.close(linger=0)
        self._ctx.term()
