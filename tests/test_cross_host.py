"""Prefill and decode on two hosts with their own addresses: two network namespaces joined
by a veth pair (10.203.0.1/24 and 10.203.0.2/24), made by this test and deleted after it,
even on failure. Each TensorRT-LLM server rank (trtllm_driver, the connector in PyExecutor's
order) enters its namespace first thing, as ``ip netns exec`` would, and binds and
advertises its namespace's address. Each namespace's 127.0.0.1 is its own, so anything
advertised as 127.0.0.1 by mistake points the other host at itself and the handoff fails;
the advertised endpoints must carry the namespace's address, and ``ss -tln`` inside each
namespace must show no listener bound to 127.0.0.1.

- a handoff byte-exact with P2PHANDSHAKE metadata (decode discovers the prefill's ranks
  through its bus across the link), and with an etcd metadata server (Debian's
  ``etcd-server``, started here inside the prefill's namespace; both Mooncake engines
  publish their segments there);
- the link cut mid-transfer (``ip link set ... down``): both sides fail cleanly within
  their bounds, every block back, the decode recomputes the prompt with the right KV, and
  once the link is back the next handoff is byte-exact.

Skipped, with the reason printed, where not root, without ``ip netns`` or without etcd.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("mooncake")

from kvbridge.adapters.trtllm import Handle  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

NET = "10.203.0"
CFG = dict(deadline_s=8.0, heartbeat_s=0.2, peer_timeout_s=1.5, quiesce_s=0.5, chunk_bytes=1 << 20)
MC_TIMEOUT_S = 3  # Mooncake's own bound on a TCP piece that makes no progress (cut link)
PROMPT = 512


def _sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30, **kw)


def _netns_unusable() -> str:
    """Why two network namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "not root: `ip netns add` needs CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"kvb-probe-{os.getpid()}"
    r = _sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return ""


def _skip(reason: str):
    print(f"\n[cross-host] skipped: {reason}")
    pytest.skip(reason)


class Hosts:
    """Two namespaces ``a`` (prefill, 10.203.0.1) and ``b`` (decode, 10.203.0.2) joined by a veth pair."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"kvb-a-{tag}", f"kvb-b-{tag}"
        self.va, self.vb = f"kva{tag}", f"kvb{tag}"
        self.ip = {self.a: f"{NET}.1", self.b: f"{NET}.2"}
        self.made: list[str] = []

    def up(self) -> None:
        for ns in (self.a, self.b):
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
        _sh("ip", "link", "add", self.va, "type", "veth", "peer", "name", self.vb)
        _sh("ip", "link", "set", self.va, "netns", self.a)
        _sh("ip", "link", "set", self.vb, "netns", self.b)
        for ns, dev in ((self.a, self.va), (self.b, self.vb)):
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip[ns]}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")  # a host reaches its own address over lo

    def link(self, up: bool) -> None:
        _sh("ip", "-n", self.a, "link", "set", self.va, "up" if up else "down")
        if up:
            _sh("ip", "-n", self.b, "link", "set", self.vb, "up")

    def listeners(self, ns: str) -> list[str]:
        """Local addresses of the TCP listeners in ``ns``."""
        out = _sh("ip", "netns", "exec", ns, "ss", "-Htln").stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def down(self) -> None:
        for ns in self.made:
            _sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


@pytest.fixture(scope="module")
def hosts():
    why = _netns_unusable()
    if why:
        _skip(why)
    h = Hosts()
    saved = {k: os.environ.get(k) for k in ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC")}
    os.environ.update(MC_TRANSFER_TIMEOUT=str(MC_TIMEOUT_S), MC_TCP_PROGRESS_TIMEOUT_SEC=str(MC_TIMEOUT_S))
    try:
        h.up()
        yield h
    finally:
        h.down()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Pair:
    """A prefill server in namespace a and a decode server in namespace b (one rank each)."""

    def __init__(self, hosts: Hosts, metadata_server: str = "P2PHANDSHAKE", throttle=None):
        from trtllm_driver import Server, pool_spec

        self.hosts = hosts
        self.pspec = pool_spec(tpb=32, blocks=48, seed=71)
        self.dspec = pool_spec(tpb=32, blocks=48, seed=72)
        extra = dict(throttle.hooks) if throttle is not None else {}
        self.pre = self.dec = None
        self.pre = Server([self.pspec], dict(CFG, host=hosts.ip[hosts.a], metadata_server=metadata_server,
                                             hooks=dict(extra, netns=hosts.a)), False)
        self.dec = Server([self.dspec], dict(CFG, host=hosts.ip[hosts.b], metadata_server=metadata_server,
                                             hooks=dict(extra, netns=hosts.b)), True)
        self.rid = 0

    def start(self, via_bus=True) -> int:
        from test_trtllm_connector import _req

        self.rid += 1
        room = 7000 + self.rid
        self.pre.step([_req(self.rid, PROMPT, 1, Handle("send", room))])
        src = {"specs": [self.pspec], "blocks": self.pre.ask("blocks", self.rid)}
        h = Handle("recv", room, prefill=self.pre.bus) if via_bus else \
            Handle("recv", room, endpoints=tuple(self.pre.sender_endpoints))
        self.dec.step([_req(1000 + self.rid, PROMPT, 2, h, source=src)])
        return 1000 + self.rid

    def until(self, servers, cond, timeout=30.0) -> float:
        from test_faults import until

        return until(servers, cond, timeout)

    def handoff_ok(self, via_bus=True) -> dict:
        from test_trtllm_connector import _done, _drained

        drid = self.start(via_bus)
        self.until([self.pre, self.dec], lambda: _done(self.dec, [drid]) and _drained(self.dec) and _drained(self.pre))
        res = self.dec.last[0]["results"][drid]
        ld = self.dec.check()[0]["finished_loads"][drid]
        assert res == {"tokens": 2, "cancelled": False, "computed": 1, "kv_ok": True}, (res, ld)
        assert ld["verdict"] == "ok" and ld["record"]["bytes"] == 2 * 2 * PROMPT * 4 * 32 * 2, ld
        return ld

    def check_addresses(self) -> None:
        """Endpoints advertised with the namespace's address; no listener on 127.0.0.1."""
        a, b = self.hosts.ip[self.hosts.a], self.hosts.ip[self.hosts.b]
        assert self.pre.bus.startswith(f"tcp://{a}:"), self.pre.bus
        assert all(e.startswith(f"tcp://{a}:") for e in self.pre.sender_endpoints), self.pre.sender_endpoints
        assert all(e.startswith(f"tcp://{b}:") for e in self.dec.sender_endpoints), self.dec.sender_endpoints
        for ns in (self.hosts.a, self.hosts.b):
            bound = self.hosts.listeners(ns)
            assert bound, f"no listener in {ns}"
            assert not [x for x in bound if x.startswith("127.")], f"{ns}: bound to loopback: {bound}"

    def stop(self) -> None:
        for s in (self.pre, self.dec):
            if s is not None:
                s.stop()


def test_handoff_across_hosts_p2phandshake(hosts):
    pair = Pair(hosts)
    try:
        t0 = time.monotonic()
        ld = pair.handoff_ok(via_bus=True)  # discovery through the prefill's bus across the link
        pair.check_addresses()
        _row("p2p_handoff", {"seconds": round(time.monotonic() - t0, 2), "bytes": ld["record"]["bytes"]})
    finally:
        pair.stop()


def _etcd_keys(hosts: Hosts, ns: str, url: str) -> list[str]:
    """Every key in the etcd at ``url`` (v3 JSON gateway), read from inside ``ns``."""
    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode(),
                       "keys_only": True})
    out = _sh("ip", "netns", "exec", ns, sys.executable, "-c",
              "import sys, urllib.request; print(urllib.request.urlopen(urllib.request.Request("
              "sys.argv[1] + '/v3/kv/range', data=sys.argv[2].encode(), method='POST'), timeout=5).read().decode())",
              url, body).stdout
    return [base64.b64decode(k["key"]).decode(errors="replace") for k in json.loads(out).get("kvs", [])]


@contextlib.contextmanager
def _etcd(prefix: list[str], ip: str, port: int):
    """An etcd serving clients at http://ip:port, run under ``prefix`` (e.g. ``ip netns exec
    NS``) on a temporary data dir; yields its URL."""
    exe = shutil.which("etcd")
    if exe is None:
        _skip("etcd is not installed (Debian: apt-get install etcd-server; scripts/sysdeps.sh does it as root)")
    data = tempfile.mkdtemp(prefix="kvb-etcd-")
    log = open(os.path.join(data, "etcd.log"), "w")
    url = f"http://{ip}:{port}"
    peer = f"http://{ip}:{port + 1}"
    proc = subprocess.Popen([*prefix, exe, "--data-dir", os.path.join(data, "d"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 20
        while True:
            r = _sh(*prefix, sys.executable, "-c",
                    "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=1)", url,
                    check=False)
            if r.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"etcd did not come up: {open(os.path.join(data, 'etcd.log')).read()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def etcd(hosts):
    with _etcd(["ip", "netns", "exec", hosts.a], hosts.ip[hosts.a], 2379) as url:
        yield url


def test_two_engines_of_one_host_with_etcd():
    """Regression: with a metadata server Mooncake names an engine's segment by its hostname
    alone, so two engines of one host (TP ranks) given the same address overwrote each
    other's segment in etcd and writes to one landed on the other (refused: outside its
    memory). MooncakeTransport now adds a free port to a bare hostname."""
    import torch

    from kvbridge.common.transport import MooncakeTransport

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with _etcd([], "127.0.0.1", port) as url:
        ms = url.removeprefix("http://")
        a, b = MooncakeTransport("127.0.0.1", ms), MooncakeTransport("127.0.0.1", ms)
        try:
            assert a.session_id != b.session_id and a.session_id.startswith("127.0.0.1:"), (a.session_id, b.session_id)
            src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
            dst = torch.zeros_like(src)
            a.register_tensor(src)
            b.register_tensor(dst)
            a.write(b.session_id, [src.data_ptr()], [dst.data_ptr()], [src.numel()])
            assert torch.equal(src, dst)
        finally:
            a.close()
            b.close()


def test_handoff_across_hosts_etcd_metadata(hosts, etcd):
    ip = hosts.ip[hosts.a]
    pair = Pair(hosts, metadata_server=f"etcd://{ip}:2379")
    try:
        t0 = time.monotonic()
        ld = pair.handoff_ok(via_bus=False)
        pair.check_addresses()
        keys = _etcd_keys(hosts, hosts.a, etcd)
        for host in (hosts.ip[hosts.a], hosts.ip[hosts.b]):  # both engines' segments are published in etcd
            assert any(host in k for k in keys), (host, keys)
        assert not any("127.0.0.1" in k for k in keys), keys
        _row("etcd_handoff", {"seconds": round(time.monotonic() - t0, 2), "bytes": ld["record"]["bytes"],
                              "etcd_keys": sorted(keys)[:8]})
    finally:
        pair.stop()


def test_link_cut_mid_transfer(hosts):
    """``ip link set`` down while the prefill writes: the decode fails the load within its
    peer timeout and recomputes (right KV); the prefill fails the room within its peer
    timeout and releases its blocks once Mooncake gives up the stuck pieces; with the link
    back, the next handoff between the same two servers is byte-exact."""
    from test_faults import Throttle, _recompute_ok, _side, _wait_file
    from test_trtllm_connector import _check_clean, _done, _drained

    th = Throttle(0.04)
    pair = Pair(hosts, throttle=th)
    try:
        pair.handoff_ok(via_bus=False)  # the link works (and both engines know each other)
        t_case = time.monotonic()
        th.on()
        pre_pid = pair.pre.ranks[0][1].pid
        drid = pair.start(via_bus=False)
        room = 7000 + pair.rid
        t_fault = _wait_file(th.started)
        hosts.link(False)
        try:
            t_dec = pair.until([pair.dec], lambda: _done(pair.dec, [drid]) and _drained(pair.dec))
            t_pre = pair.until([pair.pre], lambda: _drained(pair.pre), timeout=CFG["peer_timeout_s"] + MC_TIMEOUT_S + 10)
        finally:
            hosts.link(True)
            th.off()
        res = pair.dec.last[0]["results"][drid]
        ld = pair.dec.check()[0]["finished_loads"][drid]
        failed = th.failed_at(t_case, pre_pid, room)
        assert failed, "the prefill never failed the room"
        sides = [_side("decode", "FAILED", ld["reason"], t_dec - t_fault, CFG["peer_timeout_s"], ("unreachable",)),
                 _side("prefill", "FAILED", failed[1], failed[0] - t_fault, CFG["peer_timeout_s"],
                       ("silent", "write", "timed out", "transfer"))]
        recompute = _recompute_ok(res)
        blocks_back_s = t_pre - t_fault
        assert blocks_back_s <= CFG["peer_timeout_s"] + MC_TIMEOUT_S + 1.0, blocks_back_s
        assert not th.double_releases(t_case)
        for s in (pair.pre, pair.dec):
            _check_clean(s)
        pair.handoff_ok(via_bus=False)  # the link is back: the same two servers hand off byte-exact
        from test_faults import _record

        _record({"plugin": "trtllm", "fault": "link_cut", "ok": True, "sides": sides, "double_releases": 0,
                 "blocks_ok": True, "next_ok": True, "recompute_ok": recompute,
                 "prefill_blocks_back_s": round(blocks_back_s, 2)})
    finally:
        pair.stop()


def _row(name: str, data: dict) -> None:
    from test_faults import OUT

    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "cross_host.json")
    rows = json.load(open(path)) if os.path.exists(path) else {}
    rows[name] = data
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
