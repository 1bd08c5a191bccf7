"""SGLang's prefill bootstrap protocol, engine-neutral: an HTTP server and a client.

SGLang's disaggregation finds prefill ranks through a per-prefill-instance HTTP
*bootstrap server* (``srt/disaggregation/common/conn.py``, ``CommonKVBootstrapServer``):
every prefill rank registers with ``PUT /route`` (its TP/CP/DP/PP slot, ``rank_ip`` /
``rank_port``, ``page_size``, ``kv_cache_dtype``); a decode rank asks ``GET /route`` with
all four ranks -1 for the topology (``PrefillServerInfo``), then with its target ranks
for each prefill rank's address. kvbridge adds one record per rank (its control
endpoint, Mooncake session and layout, see ``rank_record``): returned under
``"kvbridge"`` with the rank's ``/route`` answer, and listed at ``GET /kvbridge/ranks``
(``ranks_payload``), so any kvbridge receiver, SGLang or not, finds every rank.

``BootstrapServer`` serves that protocol for a prefill that is not SGLang (the
TensorRT-LLM plugin's ``sglang_bootstrap_port``), so an SGLang decode server on the
kvbridge backend can pull from it; ``fetch_ranks`` / ``endpoints_by_tp_rank`` are the
client a non-SGLang decode uses to find an SGLang prefill (or a ``BootstrapServer``).
The SGLang adapter's own bootstrap server (a subclass of SGLang's) answers
``/kvbridge/ranks`` with ``ranks_payload`` too.

Imports aiohttp (server) lazily; the client uses only the standard library.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

__all__ = ["BootstrapError", "BootstrapServer", "endpoints_by_tp_rank", "fetch_ranks", "parse_address", "rank_record",
           "ranks_payload"]

log = logging.getLogger(__name__)

RANKS_PATH = "/kvbridge/ranks"


class BootstrapError(RuntimeError):
    """A bootstrap server that cannot be reached, is not ready in time, or answers
    something kvbridge cannot use."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises ValueError naming what is wrong."""
    if not isinstance(address, str) or address.count(":") != 1:
        raise ValueError(f"bootstrap address must be 'host:port', got {address!r}")
    host, port_s = address.split(":")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"bootstrap address must be 'host:port' with a TCP port, got {address!r}")
    return host, int(port_s)


def rank_record(*, endpoint: str, session: str, engine: str, page_size: int, layout: dict) -> dict:
    """What a prefill rank publishes for kvbridge receivers: its control endpoint, its
    Mooncake session, its engine, its own block size and its layout (``describe()``)."""
    from kvbridge.common.protocol import PROTOCOL_VERSION

    return {"version": PROTOCOL_VERSION, "endpoint": endpoint, "session": session, "engine": engine,
            "page_size": int(page_size), "layout": layout}


def ranks_payload(ranks: Mapping[tuple[int, int, int, int], dict], *, ready: bool, attn_tp_size: Any,
                  attn_cp_size: Any, dp_size: Any, pp_size: Any, page_size: Any, kv_cache_dtype: Any) -> dict:
    """The ``GET /kvbridge/ranks`` answer: the topology and, per registered rank keyed
    (dp, cp, tp, pp), its kvbridge record and SGLang address, in key order."""
    return {
        "ready": bool(ready), "attn_tp_size": attn_tp_size, "attn_cp_size": attn_cp_size, "dp_size": dp_size,
        "pp_size": pp_size, "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
        "ranks": [{"dp_rank": k[0], "cp_rank": k[1], "tp_rank": k[2], "pp_rank": k[3], **v}
                  for k, v in sorted(ranks.items())],
    }


# -- client ----------------------------------------------------------------------------


def _get_json(url: str, timeout: float) -> tuple[int, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy for a bootstrap server
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")[:300]


def fetch_ranks(address: str, timeout_s: float = 30.0, poll_s: float = 0.2) -> dict:
    """The prefill's ``GET /kvbridge/ranks`` answer from the bootstrap server at
    ``address`` ("host:port"), polled until every rank registered. Raises
    BootstrapError after ``timeout_s`` saying what it last saw (refused connection,
    HTTP status, not ready: a prefill without the kvbridge backend answers 404)."""
    host, port = parse_address(address)
    url = f"http://{host}:{port}{RANKS_PATH}"
    end, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            status, body = _get_json(url, timeout=max(0.5, min(5.0, end - time.monotonic())))
            if status == 200 and isinstance(body, dict):
                if body.get("ready") and body.get("ranks"):
                    return body
                last = f"{len(body.get('ranks') or [])} rank(s) registered, not ready"
            elif status == 404:
                last = "HTTP 404: not a kvbridge prefill (is it running with the kvbridge transfer backend?)"
            else:
                last = f"HTTP {status}: {str(body)[:200]}"
        except (OSError, ValueError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
        if time.monotonic() + poll_s > end:
            raise BootstrapError(f"bootstrap server {address}: no ready kvbridge prefill ranks within "
                                 f"{timeout_s:.1f} s ({last})")
        time.sleep(poll_s)


def endpoints_by_tp_rank(body: dict, address: str = "") -> list[str]:
    """The kvbridge control endpoints of a ``/kvbridge/ranks`` answer in TP rank order.
    Only prefills with one DP group, CP 1 and PP 1 are supported (raises BootstrapError
    naming the topology otherwise, or a missing rank)."""
    where = f"bootstrap server {address}: " if address else ""
    for key in ("dp_size", "attn_cp_size", "pp_size"):
        if int(body.get(key) or 1) != 1:
            raise BootstrapError(f"{where}prefill has {key} {body.get(key)}; kvbridge pulls from prefills with "
                                 "dp_size, attn_cp_size and pp_size 1")
    tp = int(body.get("attn_tp_size") or 0)
    by_rank = {int(r["tp_rank"]): r.get("endpoint") for r in body.get("ranks") or []}
    missing = [t for t in range(tp) if not by_rank.get(t)]
    if tp <= 0 or missing:
        raise BootstrapError(f"{where}prefill TP size {tp}, no kvbridge endpoint for TP rank(s) {missing}")
    return [str(by_rank[t]) for t in range(tp)]


# -- server ----------------------------------------------------------------------------


class BootstrapServer:
    """An SGLang-compatible bootstrap server for one prefill instance that is not SGLang.

    Serves ``GET /route`` (topology, and each rank's address with its kvbridge record),
    ``PUT /route`` (what SGLang prefill ranks send, for completeness), ``GET /health``,
    ``POST /query_dp_ranks`` (one DP group: none routed) and ``GET /kvbridge/ranks``.
    Ranks registered in-process with ``register(tp_rank, record)``.

    ``page_size`` is what the server REPORTS, and it must be the page size of the SGLang
    DECODE servers that pull from it: SGLang's decode refuses a prefill whose registered
    page size differs from its own (``try_ensure_parallel_info``: "Page size mismatch"),
    although kvbridge converts block sizes itself (the real geometry travels in each
    rank's kvbridge record). ``kv_cache_dtype`` None skips SGLang's dtype check likewise
    (kvbridge checks dtypes at the handshake).

    SGLang's decode also sends registration and abort frames over ZMQ to each prefill
    rank's ``rank_ip:rank_port``; one PULL socket bound here takes them for every rank
    (kvbridge needs none: rooms and aborts travel on kvbridge's own channel).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, page_size: int = 1, tp_size: int = 1,
                 kv_cache_dtype: str | None = None):
        import zmq
        from aiohttp import web

        if page_size <= 0 or tp_size <= 0:
            raise ValueError(f"page_size and tp_size must be positive, got {page_size}, {tp_size}")
        self.host, self.page_size, self.tp_size, self.kv_cache_dtype = host, int(page_size), int(tp_size), kv_cache_dtype
        self._ranks: dict[tuple[int, int, int, int], dict] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise BootstrapError(f"cannot bind the bootstrap server to {host}:{port}: {e}") from None
        self.port = self._sock.getsockname()[1]
        self._zctx = zmq.Context.instance()
        self._pull = self._zctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.rank_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._stop = threading.Event()
        self._drainer = threading.Thread(target=self._drain, daemon=True, name="kvbridge-bootstrap-drain")
        self._drainer.start()
        app = web.Application()
        app.router.add_route("*", "/route", self._route)
        app.router.add_get("/health", self._health)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get(RANKS_PATH, self._kvbridge_ranks)
        self._web = web
        self._runner = web.AppRunner(app, access_log=None)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kvbridge-bootstrap")
        self._thread.start()
        if not self._started.wait(10) or self._error is not None:
            self.close()
            raise BootstrapError(f"bootstrap server on {host}:{self.port} did not start: {self._error!r}")
        log.info("kvbridge bootstrap server (SGLang protocol) at %s, page size %d reported", self.address, page_size)

    @property
    def address(self) -> str:
        """``host:port``: what SGLang requests name as ``bootstrap_host`` / ``bootstrap_port``."""
        return f"{self.host}:{self.port}"

    def register(self, tp_rank: int, record: dict) -> None:
        """Register prefill TP rank ``tp_rank`` with its kvbridge record (``version``,
        ``endpoint``, ``session``, ``engine``, ``page_size``, ``layout``)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside TP size {self.tp_size}")
        if not isinstance(record, dict) or not record.get("endpoint"):
            raise ValueError(f"rank {tp_rank}: a kvbridge record needs an endpoint, got {record!r:.200}")
        with self._lock:
            self._ranks[(0, 0, int(tp_rank), 0)] = {**record, "rank_ip": self.host, "rank_port": self.rank_port}

    def ready(self) -> bool:
        """Whether every TP rank registered."""
        with self._lock:
            return len(self._ranks) >= self.tp_size

    # -- HTTP ------------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(self._web.SockSite(self._runner, self._sock).start())
        except BaseException as e:  # reported to __init__
            self._error = e
            self._started.set()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    def _info(self) -> dict:
        return {"attn_tp_size": self.tp_size, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                "page_size": self.page_size, "kv_cache_dtype": self.kv_cache_dtype, "follow_bootstrap_room": True,
                "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
                "prefill_http_port": None, "decode_allocation_policy": "early"}

    async def _route(self, request):
        web = self._web
        if request.method == "PUT":
            data = await request.json()
            try:
                tp_rank = int(data["attn_tp_rank"])
                rec = data.get("kvbridge") or {}
                self.register(tp_rank, rec)
            except (KeyError, TypeError, ValueError) as e:
                return web.Response(text=f"bad registration: {e}", status=400)
            return web.Response(text="OK", status=200)
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405)
        q = request.query
        try:
            key = tuple(int(q[k]) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except (KeyError, ValueError):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if not self.ready():
            return web.Response(text=f"Prefill server not fully registered yet ({len(self._ranks)} registered).",
                                status=503)
        if key == (-1, -1, -1, -1):
            return web.json_response(self._info())
        with self._lock:
            rec = self._ranks.get(key)
        if rec is None:
            return web.Response(text=f"Bootstrap info not found for {key}", status=404)
        body = {"rank_ip": rec["rank_ip"], "rank_port": rec["rank_port"],
                "kvbridge": {k: v for k, v in rec.items() if k not in ("rank_ip", "rank_port")}}
        return web.json_response(body)

    async def _health(self, request):
        return self._web.Response(text="OK", status=200)

    async def _query_dp_ranks(self, request):
        return self._web.json_response({})  # one DP group: no room is routed to another

    async def _kvbridge_ranks(self, request):
        with self._lock:
            ranks = dict(self._ranks)
        return self._web.json_response(ranks_payload(
            ranks, ready=len(ranks) >= self.tp_size, attn_tp_size=self.tp_size, attn_cp_size=1, dp_size=1, pp_size=1,
            page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype))

    # -- SGLang's ZMQ frames to rank_port ----------------------------------------------
    def _drain(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(200):
                    frames = self._pull.recv_multipart(zmq.NOBLOCK)
                    log.debug("bootstrap: SGLang frame %r from a decode rank (not needed by kvbridge)",
                              frames[0][:32] if frames else b"")
            except zmq.ZMQError:
                if self._stop.is_set():
                    return

    def close(self) -> None:
        """Stop serving and release the ports."""
        self._stop.set()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join(5)
        self._drainer.join(2)
        self._pull.close(linger=0)
        self._sock.close()
