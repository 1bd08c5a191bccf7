"""SGLang's prefill bootstrap protocol, engine-neutral: an HTTP server and a client.

SGLang's disaggregation finds prefill ranks through a per-prefill-instance HTTP
*bootstrap server* (``srt/disaggregation/common/conn.py``, ``CommonKVBootstrapServer``):
every prefill rank registers with ``PUT /route`` (its TP/CP/DP/PP slot, ``rank_ip`` /
``rank_port``, ``page_size``, ``kv_cache_dtype``); a decode rank asks ``GET /route`` with
all four ranks -1 for the topology (``PrefillServerInfo``), then with its target ranks
for each prefill rank's address. kvbridge adds one record per rank (its control
endpoint, Mooncake session and layout, a ``kvbridge.common.protocol.RankRecord``): returned under
``"kvbridge"`` with the rank's ``/route`` answer, and listed at ``GET /kvbridge/ranks``
(``ranks_payload``), so any kvbridge receiver, SGLang or not, finds every rank.

``BootstrapServer`` serves that protocol for a prefill that is not SGLang (the
TensorRT-LLM plugin's ``sglang_bootstrap_port``), so an SGLang decode server on the
kvbridge backend can pull from it; ``fetch_ranks`` / ``rank_records`` / ``endpoints_by_tp_rank`` are the
client a non-SGLang decode uses to find an SGLang prefill (or a ``BootstrapServer``).
The SGLang adapter's own bootstrap server (a subclass of SGLang's) answers
``/kvbridge/ranks`` with ``ranks_payload`` too.

Sealed records (``kvbridge.common.auth``, domain ``b"rank-record"``): with a secret set,
nobody without it can publish a rank or make a reader trust one. Two seals, because a
seal lives only ``replay_window_s`` and is accepted once per process, while a record is
read for as long as the prefill runs:

* Publishing (``PUT /route``): the rank seals the canonical JSON (``canonical``: sorted
  keys, no spaces) of its whole registration body, the ``"kvbridge"`` record included, and
  sends it base64 in the body's ``"kvbridge_seal"`` field (``seal_record``). A
  bootstrap server with a keyring opens it (fresh, not replayed, an accepted key) and
  checks it covers the body as received, field for field; anything else is refused
  with HTTP 401 naming why (``check_registration``), changes nothing, and is counted in
  ``kvbridge_refused_frames_total{channel="rank_record"}``. A TensorRT-LLM rank's record
  comes over the sealed bus instead (``Hello``), a vLLM rank's in-process.
* Reading: the bootstrap server (a key holder in the prefill's deployment) seals each
  rank entry it serves, at serve time: in ``GET /kvbridge/ranks`` each entry's
  ``"kvbridge_seal"`` covers the entry (its TP/DP/CP/PP slot, endpoint, session, layout,
  ``rank_ip`` / ``rank_port``); in ``GET /route`` the rank answer's ``"kvbridge_seal"``
  covers ``{"key": [dp, cp, tp, pp], "kvbridge": record, "rank_ip", "rank_port"}``.
  A reader with a keyring (``fetch_ranks(..., keyring=)``, ``open_route_info``) keeps
  only what the seal carries: an entry without a valid seal is dropped, counted and
  logged (rate-limited), so a forged or altered record is never used.

Without a secret (keyring None) records are plain, as before. The ranks a server holds
are capped (``MAX_RANKS``: SGLang's PUT keys come from the body).

Imports aiohttp (server) lazily; the client uses only the standard library.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

import msgspec

from .protocol import ProtocolError, RankRecord

__all__ = ["BootstrapError", "BootstrapServer", "endpoints_by_tp_rank", "fetch_ranks", "parse_address", "rank_records",
           "ranks_payload", "canonical", "seal_record", "check_registration", "open_entry",
           "seal_route_info", "open_route_info", "read_registration", "RECORD_DOMAIN", "SEAL_FIELD", "MAX_RANKS"]

log = logging.getLogger(__name__)

RANKS_PATH = "/kvbridge/ranks"
RECORD_DOMAIN = b"rank-record"  # kvbridge.common.auth domain of every rank-record seal
SEAL_FIELD = "kvbridge_seal"  # base64 of the seal, beside what it covers
MAX_RANKS = 4096  # rank entries a bootstrap server holds (dp x cp x tp x pp slots)
_MAX_SEALED = 1 << 20  # bytes of one sealed record
_MAX_ANSWER = 64 << 20  # bytes of a bootstrap server's answer a reader takes (MAX_RANKS records, with room)


# -- seals -------------------------------------------------------------------------------


def canonical(obj: Any) -> bytes:
    """The bytes a record seal covers: JSON with sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _unsealed(d: Mapping) -> dict:
    return {k: v for k, v in d.items() if k != SEAL_FIELD}


def _seal(obj: Any, keyring) -> str:
    return base64.b64encode(keyring.seal(canonical(obj), RECORD_DOMAIN)).decode("ascii")


def _open(d: Mapping, keyring) -> Any:
    """What ``d``'s seal carries (parsed), or ``AuthError``."""
    from .auth import AuthError

    seal = d.get(SEAL_FIELD) if isinstance(d, Mapping) else None
    if not isinstance(seal, str) or not seal:
        raise AuthError("unsigned", f"no {SEAL_FIELD} (the publisher has no secret, or is not kvbridge)")
    try:
        frame = base64.b64decode(seal, validate=True)
    except (binascii.Error, ValueError):
        raise AuthError("unsigned", f"{SEAL_FIELD} is not base64") from None
    payload = keyring.open(frame, RECORD_DOMAIN, _MAX_SEALED)
    try:
        return json.loads(payload)
    except ValueError:  # sealed by a key holder, yet not JSON: refuse all the same
        raise AuthError("bad_message", "sealed record is not JSON") from None


def seal_record(record: dict, keyring) -> dict:
    """``record`` (a rank's ``PUT /route`` body, or a ``/kvbridge/ranks`` entry) with a
    seal over all of it (unchanged when ``keyring`` is None)."""
    if keyring is None:
        return record
    record = _unsealed(record)
    return {**record, SEAL_FIELD: _seal(record, keyring)}


def check_registration(body: Any, keyring) -> None:
    """Raise ``AuthError`` unless ``body`` (a ``PUT /route`` body as received) carries a
    valid seal covering exactly its other fields; no keyring: nothing checked."""
    from .auth import AuthError

    if keyring is None:
        return
    if not isinstance(body, dict):
        raise AuthError("bad_message", "registration is not a JSON object")
    if canonical(_open(body, keyring)) != canonical(_unsealed(body)):
        raise AuthError("bad_tag", "registration differs from what its seal covers (altered)")


def open_entry(entry: Any, keyring) -> dict:
    """The entry its seal carries (``AuthError`` when there is none valid); no keyring:
    the entry as it is."""
    from .auth import AuthError

    if keyring is None:
        return entry
    rec = _open(entry, keyring)
    if not isinstance(rec, dict):
        raise AuthError("bad_message", "sealed rank entry is not an object")
    return rec


def seal_route_info(body: dict, key: tuple, keyring) -> dict:
    """A ``GET /route`` rank answer (``rank_ip``, ``rank_port``, ``kvbridge``) with a seal
    binding them to the rank slot ``key`` (dp, cp, tp, pp)."""
    if keyring is None or not isinstance(body.get("kvbridge"), dict):
        return body
    covered = {"key": [int(k) for k in key], "kvbridge": body["kvbridge"], "rank_ip": body.get("rank_ip"),
               "rank_port": body.get("rank_port")}
    return {**_unsealed(body), SEAL_FIELD: _seal(covered, keyring)}


def open_route_info(info: dict, key: tuple, keyring) -> dict:
    """``info`` (a ``GET /route`` rank answer for slot ``key``) with ``kvbridge``,
    ``rank_ip`` and ``rank_port`` as its seal carries them; ``AuthError`` when the seal is
    missing, invalid or for another slot. No keyring: ``info`` as it is."""
    from .auth import AuthError

    if keyring is None:
        return info
    c = _open(info, keyring)
    if not isinstance(c, dict) or c.get("key") != [int(k) for k in key] or not isinstance(c.get("kvbridge"), dict):
        raise AuthError("bad_tag", f"sealed route answer is for rank slot {c.get('key') if isinstance(c, dict) else '?'}, "
                                   f"not {list(key)}")
    return {**_unsealed(info), "kvbridge": c["kvbridge"], "rank_ip": c.get("rank_ip"), "rank_port": c.get("rank_port")}


async def read_registration(request, keyring, where: str):
    """A ``PUT /route`` body (aiohttp ``request``) and None, or None and the answer that
    refuses it: 400 when it is not JSON, 401 naming why when ``keyring`` is set and its
    seal does not hold (counted and logged, ``refused``)."""
    from aiohttp import web

    from .auth import AuthError

    try:
        data = await request.json()
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        return None, web.Response(text=f"bad registration: not JSON: {type(e).__name__}: {str(e)[:200]}", status=400)
    try:
        check_registration(data, keyring)
    except AuthError as e:
        refused(e, f"{where}: PUT /route from {request.remote}")
        return None, web.Response(text=f"registration refused ({e.code}): {e}; a rank must seal its registration "
                                       "with the deployment's secret (KVBRIDGE_SECRET)", status=401)
    return data, None


_refusal_logs: dict[str, Any] = {}


def refused(err: Exception, where: str, channel: str = "rank_record") -> None:
    """Count a refused record (``kvbridge_refused_frames_total{channel}``) and log it, rate-limited."""
    from .limits import LogLimiter
    from .rooms import default_metrics

    code = getattr(err, "code", "bad_message")
    default_metrics().refused(channel, code)
    lim = _refusal_logs.get(channel)
    if lim is None:
        lim = _refusal_logs.setdefault(channel, LogLimiter(log, f"kvbridge: refused {channel.replace('_', ' ')}s"))
    lim.warn(code, "%s: %s", where, err)


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


def ranks_payload(ranks: Mapping[tuple[int, int, int, int], dict], *, ready: bool, attn_tp_size: Any,
                  attn_cp_size: Any, dp_size: Any, pp_size: Any, page_size: Any, kv_cache_dtype: Any,
                  keyring=None) -> dict:
    """The ``GET /kvbridge/ranks`` answer: the topology and, per registered rank keyed
    (dp, cp, tp, pp), its kvbridge record and SGLang address, in key order; with
    ``keyring`` each entry sealed (``seal_record``)."""
    return {
        "ready": bool(ready), "attn_tp_size": attn_tp_size, "attn_cp_size": attn_cp_size, "dp_size": dp_size,
        "pp_size": pp_size, "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
        "ranks": [seal_record({"dp_rank": k[0], "cp_rank": k[1], "tp_rank": k[2], "pp_rank": k[3], **v}, keyring)
                  for k, v in sorted(ranks.items())],
    }


# -- client ----------------------------------------------------------------------------


def _get_json(url: str, timeout: float) -> tuple[int, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy for a bootstrap server
    try:
        with opener.open(url, timeout=timeout) as r:
            data = r.read(_MAX_ANSWER + 1)
            if len(data) > _MAX_ANSWER:
                raise ValueError(f"answer larger than {_MAX_ANSWER} bytes")
            try:
                return r.status, json.loads(data.decode())
            except RecursionError:
                raise ValueError("answer is JSON nested past the parser's depth") from None
    except urllib.error.HTTPError as e:
        return e.code, e.read(300).decode("utf-8", "replace")


def _verified(body: dict, keyring, address: str) -> tuple[dict, list[str]]:
    """``body`` with only the rank entries whose seal holds (each as its seal carries it),
    and why the others were refused (each counted and logged, rate-limited)."""
    from .auth import AuthError

    if keyring is None:
        return body, []
    kept, why = [], []
    ranks = body.get("ranks")
    for entry in ranks if isinstance(ranks, list) else []:
        try:
            kept.append(open_entry(entry, keyring))
        except AuthError as e:
            refused(e, f"bootstrap server {address}: rank entry")
            why.append(getattr(e, "code", "bad_message"))
    return {**body, "ranks": kept}, why


def fetch_ranks(address: str, timeout_s: float = 30.0, poll_s: float = 0.2, keyring=None) -> dict:
    """The prefill's ``GET /kvbridge/ranks`` answer from the bootstrap server at
    ``address`` ("host:port"), polled until every rank registered. Raises
    BootstrapError after ``timeout_s`` saying what it last saw (refused connection,
    HTTP status, not ready: a prefill without the kvbridge backend answers 404).
    ``keyring`` (the deployment's ``Keyring``; None: auth off): only rank entries whose
    seal holds are kept, as their seal carries them; while any entry is refused the
    answer is not taken (asked again until ``timeout_s``)."""
    host, port = parse_address(address)
    url = f"http://{host}:{port}{RANKS_PATH}"
    end, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            status, body = _get_json(url, timeout=max(0.5, min(5.0, end - time.monotonic())))
            if status == 200 and isinstance(body, dict):
                body, why = _verified(body, keyring, address)
                if why:
                    last = (f"{len(why)} rank record(s) refused ({', '.join(sorted(set(why)))}): not sealed with this "
                            "deployment's secret")
                elif body.get("ready") and body.get("ranks"):
                    return body
                else:
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


def rank_records(body: dict, address: str = "") -> list[RankRecord]:
    """The rank records of a ``/kvbridge/ranks`` answer in TP rank order. Only prefills
    with one DP group, CP 1 and PP 1 are supported (raises BootstrapError naming the
    topology otherwise, a missing rank, or the field of a record that is not valid)."""
    where = f"bootstrap server {address}: " if address else ""
    try:
        sizes = {key: int(body.get(key) or 1) for key in ("dp_size", "attn_cp_size", "pp_size")}
        tp = int(body.get("attn_tp_size") or 0)
        by_rank = {int(r["tp_rank"]): r for r in body.get("ranks") or [] if isinstance(r, dict) and r.get("endpoint")}
    except (TypeError, ValueError, KeyError) as e:
        raise BootstrapError(f"{where}a size or a rank's tp_rank is not an integer: {type(e).__name__}: {e}") from None
    for key, size in sizes.items():
        if size != 1:
            raise BootstrapError(f"{where}prefill has {key} {size}; kvbridge pulls from prefills with "
                                 "dp_size, attn_cp_size and pp_size 1")
    if tp > MAX_RANKS:
        raise BootstrapError(f"{where}prefill TP size {tp} is over the {MAX_RANKS} ranks a bootstrap server holds")
    missing = [t for t in range(tp) if t not in by_rank]
    if tp <= 0 or missing:
        raise BootstrapError(f"{where}prefill TP size {tp}, no kvbridge endpoint for TP rank(s) {missing}")
    try:
        return [RankRecord.parse(by_rank[t], f"TP rank {t}'s record") for t in range(tp)]
    except ProtocolError as e:
        raise BootstrapError(f"{where}{e}") from None


def endpoints_by_tp_rank(body: dict, address: str = "") -> list[str]:
    """The kvbridge control endpoints of a ``/kvbridge/ranks`` answer in TP rank order
    (``rank_records``)."""
    return [r.endpoint for r in rank_records(body, address)]


# -- server ----------------------------------------------------------------------------


class BootstrapServer:
    """An SGLang-compatible bootstrap server for one prefill instance that is not SGLang.

    Serves ``GET /route`` (topology, and each rank's address with its kvbridge record),
    ``PUT /route`` (what SGLang prefill ranks send, for completeness), ``GET /health``,
    ``POST /query_dp_ranks`` (one DP group: none routed) and ``GET /kvbridge/ranks``.
    Ranks registered in-process with ``register(tp_rank, record)``. With ``keyring``
    (the deployment's; module docstring) a ``PUT /route`` must be sealed and every rank
    entry served is sealed; a routable ``host`` without one refuses to start unless
    ``allow_insecure``.

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
                 kv_cache_dtype: str | None = None, keyring=None, allow_insecure: bool = False):
        import zmq
        from aiohttp import web

        from .auth import check_bind

        if page_size <= 0 or tp_size <= 0:
            raise ValueError(f"page_size and tp_size must be positive, got {page_size}, {tp_size}")
        if tp_size > MAX_RANKS:
            raise ValueError(f"tp_size {tp_size} exceeds {MAX_RANKS} ranks")
        # a routable bind needs the deployment's keyring (its records sealed) unless allow_insecure
        check_bind(host, "keyring" if keyring is not None else "", allow_insecure, "the kvbridge bootstrap server")
        self.keyring = keyring
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
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_SEALED)  # a larger frame drops its connection unread
        self._pull.setsockopt(zmq.RCVHWM, 64)
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

    def register(self, tp_rank: int, record: RankRecord | dict) -> None:
        """Register prefill TP rank ``tp_rank`` with its kvbridge record (a ``RankRecord``,
        or its JSON form: ``ProtocolError`` naming the field that is not valid)."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside TP size {self.tp_size}")
        if not isinstance(record, RankRecord):
            record = RankRecord.parse(record, f"rank {tp_rank}'s kvbridge record")
        with self._lock:
            self._ranks[(0, 0, int(tp_rank), 0)] = {**msgspec.to_builtins(record), "rank_ip": self.host,
                                                    "rank_port": self.rank_port}

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
            data, refusal = await read_registration(request, self.keyring, f"bootstrap server {self.address}")
            if refusal is not None:
                return refusal
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
        return web.json_response(seal_route_info(body, key, self.keyring))

    async def _health(self, request):
        return self._web.Response(text="OK", status=200)

    async def _query_dp_ranks(self, request):
        return self._web.json_response({})  # one DP group: no room is routed to another

    async def _kvbridge_ranks(self, request):
        with self._lock:
            ranks = dict(self._ranks)
        return self._web.json_response(ranks_payload(
            ranks, ready=len(ranks) >= self.tp_size, attn_tp_size=self.tp_size, attn_cp_size=1, dp_size=1, pp_size=1,
            page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype, keyring=self.keyring))

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
