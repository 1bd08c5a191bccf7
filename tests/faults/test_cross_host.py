"""Prefill and decode on two hosts with their own addresses: two network namespaces joined
by a veth pair (10.203.0.1/24 and 10.203.0.2/24), made by this test and deleted after it,
even on failure. Each TensorRT-LLM server rank (the TensorRT-LLM stand-in,
``kvbridge.demo.trtllm``, one OS process per rank) enters its namespace first thing, as
``ip netns exec`` would, and binds and advertises its namespace's address. Each
namespace's 127.0.0.1 is its own, so anything advertised as 127.0.0.1 by mistake points the
other host at itself and the handoff fails; the advertised endpoints must carry the
namespace's address, and ``ss -tln`` inside each namespace must show no listener bound to
127.0.0.1. The test process plays the router: it reaches each host's bus (to announce
handoffs) over a link of its own into each namespace, as a router on a management network
would.

- a handoff byte-exact with P2PHANDSHAKE metadata (decode discovers the prefill's ranks
  through its bus across the link), and with an etcd metadata server (Debian's
  ``etcd-server``, started here inside the prefill's namespace; both Mooncake engines
  publish their segments there);
- the link cut mid-transfer (``ip link set ... down``), with throttled writes and with the
  transport's defaults over a link rate-limited by ``tc tbf`` (see test_faults.py): both
  sides fail cleanly within their bounds, every block back, the decode recomputes the
  prompt with the model (KV equal to transformers'), and once the link is back the next
  handoff is byte-exact;
- the fault matrix's kill rows at the transport's defaults (``kill_*_defaults``): a server
  killed while its transfer crosses the rate-limited link.

Skipped, with the reason printed, where not root, without ``ip netns`` or without etcd.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
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

import mooncake  # noqa: F401  (pinned: a missing one fails the run, never skips)

from kvbridge.adapters.trtllm import Handle  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

MC_TIMEOUT_S = 3  # Mooncake's own bound on a TCP piece that makes no progress (cut link)
TRT_RATE = "1mbit"  # the link for the defaults rows: a 256-token prompt (128 KiB) takes about a second
_TAGS = itertools.count()


def _sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30, **kw)


def _netns_unusable() -> str:
    """Why two network namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "not root: `ip netns add` needs CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
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
    """Two namespaces ``a`` (prefill, 10.203.N.1) and ``b`` (decode, 10.203.N.2) joined by
    a veth pair, and a link from this process's namespace into each (10.205.N.0/29) with a
    route to that host's address: the router's network."""

    def __init__(self, index: int = 0):
        tag = f"{os.getpid() % 10000}{next(_TAGS)}"
        self.a, self.b = f"kvb-a-{tag}", f"kvb-b-{tag}"
        self.va, self.vb = f"kva{tag}", f"kvb{tag}"
        self.net = f"10.203.{index}"
        self.ip = {self.a: f"{self.net}.1", self.b: f"{self.net}.2"}
        self.router = {self.a: (f"kra{tag}", f"kxa{tag}", f"10.205.{index}.1", f"10.205.{index}.2"),
                       self.b: (f"krb{tag}", f"kxb{tag}", f"10.205.{index}.5", f"10.205.{index}.6")}
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
        for ns, (mine, theirs, my_ip, their_ip) in self.router.items():
            _sh("ip", "link", "add", mine, "type", "veth", "peer", "name", theirs)
            _sh("ip", "link", "set", theirs, "netns", ns)
            _sh("ip", "addr", "add", f"{my_ip}/30", "dev", mine)
            _sh("ip", "link", "set", mine, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{their_ip}/30", "dev", theirs)
            _sh("ip", "-n", ns, "link", "set", theirs, "up")
            _sh("ip", "route", "add", f"{self.ip[ns]}/32", "via", their_ip)

    def link(self, up: bool) -> None:
        _sh("ip", "-n", self.a, "link", "set", self.va, "up" if up else "down")
        if up:
            _sh("ip", "-n", self.b, "link", "set", self.vb, "up")

    def limit(self, rate: str) -> None:
        """The prefill -> decode direction of the link limited to ``rate`` (``tc tbf``; a
        short queue, so control messages are not held behind a second of data)."""
        _sh("ip", "netns", "exec", self.a, "tc", "qdisc", "replace", "dev", self.va, "root", "tbf", "rate", rate,
            "burst", "32kbit", "latency", "100ms")

    def unlimit(self) -> None:
        _sh("ip", "netns", "exec", self.a, "tc", "qdisc", "del", "dev", self.va, "root", check=False)

    def listeners(self, ns: str) -> list[str]:
        """Local addresses of the TCP listeners in ``ns``."""
        out = _sh("ip", "netns", "exec", ns, "ss", "-Htln").stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def down(self) -> None:
        for mine, *_ in self.router.values():
            _sh("ip", "link", "del", mine, check=False)
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


def _pair(hosts: Hosts, model, metadata_server: str = "P2PHANDSHAKE"):
    """A prefill server in namespace a and a decode server in namespace b (one rank each),
    with the fault hooks (test_faults.TRTServers)."""
    from tests.faults.test_faults import TRTServers

    per_role = {role: {"plugin": {"host": hosts.ip[ns], "metadata_server": metadata_server}, "hooks": {"netns": ns}}
                for role, ns in (("prefill", hosts.a), ("decode", hosts.b))}
    return TRTServers(model, per_role=per_role)


@pytest.fixture(scope="module")
def pair(hosts, tiny_llama_dir):
    p = _pair(hosts, tiny_llama_dir)
    yield p
    p.close()


def check_addresses(pair, hosts: Hosts) -> None:
    """Endpoints advertised with the namespace's address; no listener on 127.0.0.1."""
    a, b = hosts.ip[hosts.a], hosts.ip[hosts.b]
    assert pair.pre.bus.startswith(f"tcp://{a}:"), pair.pre.bus
    assert all(e.startswith(f"tcp://{a}:") for e in pair.pre.sender_endpoints), pair.pre.sender_endpoints
    assert all(e.startswith(f"tcp://{b}:") for e in pair.dec.sender_endpoints), pair.dec.sender_endpoints
    for ns in (hosts.a, hosts.b):
        bound = hosts.listeners(ns)
        assert bound, f"no listener in {ns}"
        assert not [x for x in bound if x.startswith("127.")], f"{ns}: bound to loopback: {bound}"


def test_handoff_across_hosts_p2phandshake(hosts, pair):
    t0 = time.monotonic()
    # discovery through the prefill's bus across the link
    ld = pair.request_ok(handle=lambda room: Handle("recv", room, prefill=pair.pre.bus))
    check_addresses(pair, hosts)
    # seconds: the decode's handoff (its receiver's record); case_s: the whole case, checks included
    _row("p2p_handoff", {"seconds": round(ld["record"]["seconds"], 3), "bytes": ld["record"]["bytes"],
                         "case_s": round(time.monotonic() - t0, 2)})


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
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited: {open(os.path.join(data, 'etcd.log')).read()[-2000:]}")
        return _sh(*prefix, sys.executable, "-c",
                   "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=1)", url,
                   check=False).returncode == 0

    try:
        from tests.helpers.kvhelpers import wait_until

        wait_until(healthy, 20, "etcd did not come up", poll_s=0.1)
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


def test_handoff_across_hosts_etcd_metadata(hosts, etcd, tiny_llama_dir):
    pair = _pair(hosts, tiny_llama_dir, metadata_server=f"etcd://{hosts.ip[hosts.a]}:2379")
    try:
        t0 = time.monotonic()
        ld = pair.request_ok()  # the prefill's endpoints in the decode's handle
        check_addresses(pair, hosts)
        keys = _etcd_keys(hosts, hosts.a, etcd)
        for host in (hosts.ip[hosts.a], hosts.ip[hosts.b]):  # both engines' segments are published in etcd
            assert any(host in k for k in keys), (host, keys)
        assert not any("127.0.0.1" in k for k in keys), keys
        _row("etcd_handoff", {"seconds": round(ld["record"]["seconds"], 3), "bytes": ld["record"]["bytes"],
                              "case_s": round(time.monotonic() - t0, 2), "etcd_keys": sorted(keys)[:8]})
    finally:
        pair.close()


@contextlib.contextmanager
def _armed(pair, hosts: Hosts, mode: str):
    """The pair's next transfer throttled (``mode="throttled"``), or at the transport's
    defaults over the link limited to ``TRT_RATE``; undone on exit."""
    from tests.faults.test_faults import DEFAULTS, TRT_THROTTLED

    if mode == "defaults":
        hosts.limit(TRT_RATE)
    try:
        pair.switch.on(TRT_THROTTLED if mode == "throttled" else DEFAULTS)
        yield
    finally:
        pair.switch.off()
        hosts.unlimit()


@pytest.mark.parametrize("mode", ["throttled", "defaults"])
def test_link_cut_mid_transfer(hosts, pair, mode):
    """``ip link set`` down while the prefill writes (throttled, or at the transport's
    defaults over the rate-limited link): the decode fails the load within its peer
    timeout and recomputes the prompt with the model (KV equal to transformers'); the
    prefill fails the room within its peer timeout and releases its blocks once Mooncake
    gives up the stuck pieces; with the link back, the next handoff between the same two
    servers is byte-exact."""
    from tests.faults.test_faults import _answered, _ended, _record, _side, _trt_state, _until
    from tests.helpers.trtllm_servers import check_clean

    cfg = pair.plugin
    pair.request_ok()  # the link works (and both engines know each other)
    t_case = time.monotonic()
    marks: dict = {}

    def both_ended() -> bool:
        if "dec" not in marks and _answered(pair.dec, h.drid):
            marks["dec"] = time.monotonic()
        if "pre" not in marks and pair.pre.drained():
            marks["pre"] = time.monotonic()
        return len(marks) == 2

    with _armed(pair, hosts, mode):
        h = pair.start()
        _until([pair.pre, pair.dec], pair.switch.started)
        hosts.link(False)
        t_fault = time.monotonic()
        try:
            # the prefill settles once Mooncake gave its pieces up; the decode gives the prefill
            # up, but nothing proves it quiet over a cut link: the request waits, its blocks
            # quarantined, until the link is back and the prefill answers the repeated abort
            _until([pair.pre, pair.dec], lambda: both_ended() or (
                "pre" in marks and pair.switch.logged(t_fault, pair.dec.pid(), "quarantined") is not None),
                timeout=cfg["peer_timeout_s"] + MC_TIMEOUT_S + 10)
            assert "dec" not in marks, "the decode's blocks went back while the prefill was cut off"
            t_gone = pair.switch.logged(t_fault, pair.dec.pid(), "failing")
        finally:
            hosts.link(True)
        _until([pair.pre, pair.dec], both_ended, timeout=cfg["peer_timeout_s"] + 10)
    ld = pair.dec.state()["finished_loads"][h.drid]
    sv = pair.pre.state()["finished_saves"][h.prid]
    assert ld["verdict"] == "recompute", ld
    sides = [_side("decode", _trt_state(ld), ld["reason"], t_gone - t_fault, cfg["peer_timeout_s"],
                   ("unreachable",)),
             _side("prefill", _trt_state(sv), (sv["record"] or {}).get("reason", ""), _ended(sv, marks["pre"]) - t_fault,
                   cfg["peer_timeout_s"], ("silent", "write", "timed out", "transfer"), want=("FAILED", "ABORTED"))]
    recompute = pair.computed_right(h)
    blocks_back_s = marks["pre"] - t_fault
    assert blocks_back_s <= cfg["peer_timeout_s"] + MC_TIMEOUT_S + 1.0, blocks_back_s
    assert not pair.switch.double_releases(t_case)
    check_clean(pair.pre)
    check_clean(pair.dec)
    pair.request_ok()  # the link is back: the same two servers hand off byte-exact
    _record({"plugin": "trtllm", "fault": "link_cut" if mode == "throttled" else "link_cut_defaults", "ok": True,
             "sides": sides, "double_releases": 0, "blocks_ok": True, "next_ok": True, "recompute_ok": recompute,
             "transport": mode, "blocks_back_s": round(blocks_back_s, 2), "case_s": round(time.monotonic() - t_case, 2)})


@pytest.mark.parametrize("fault", ["kill_decode", "kill_prefill"])
def test_kill_mid_transfer_transport_defaults(hosts, pair, fault):
    """The fault matrix's kill rows at the transport's defaults (no throttle, no delay):
    the transfer crosses the link rate-limited to ``TRT_RATE`` and the server is killed
    as soon as the first piece is submitted. The survivor fails within the peer timeout
    (had the transfer finished first, the prefill would report success / the decode would
    not recompute), a restarted server takes over, byte-exact (test_faults.trt_kill)."""
    from tests.faults.test_faults import _record, _until, trt_kill
    from tests.helpers.trtllm_servers import check_clean

    t_case = time.monotonic()
    sides: list[dict] = []
    with _armed(pair, hosts, "defaults"):
        h = pair.start()
        _until([pair.pre, pair.dec], pair.switch.started)
        recompute = trt_kill(pair, fault, h, sides)
    assert not pair.switch.double_releases(t_case)
    check_clean(pair.pre)
    check_clean(pair.dec)
    pair.request_ok()
    _record({"plugin": "trtllm", "fault": fault + "_defaults", "ok": True, "sides": sides, "double_releases": 0,
             "blocks_ok": True, "next_ok": True, "recompute_ok": recompute, "transport": "defaults",
             "case_s": round(time.monotonic() - t_case, 2)})


def _row(name: str, data: dict) -> None:
    from tests.faults.test_faults import OUT

    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "cross_host.json")
    rows = json.load(open(path)) if os.path.exists(path) else {}
    rows[name] = data
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
