"""SGLang's ABORT notices to a kvbridge prefill rank (its Common PULL socket) and the
kvbridge SGLang bootstrap server, with the deployment's secret set.

The prefill's control loop (``KVBridgeKVManager._prefill_control_loop``, the real one,
on a bare manager: its PULL socket, a recording sender) must abort a room only for a
notice sealed by kvbridge's decode side (``KVBridgeKVReceiver._send_abort_notification``,
the real one): an unsigned ``[b"ABORT", room]``, a replayed sealed notice, one sealed
for another rank, or with an unknown key, aborts nothing and is counted
(``channel="sglang_abort"``). The bootstrap server refuses an unsealed ``PUT /route``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import zmq

from kvbridge.adapters.sglang.manager import KVBridgeKVManager
from kvbridge.adapters.sglang.receiver import KVBridgeKVReceiver
from kvbridge.common.auth import Keyring
from kvbridge.common.handoff import RoomState
from kvbridge.common.rooms import default_metrics
from tests.helpers.kvhelpers import tiny_record, wait_until

pytestmark = [pytest.mark.timeout(120)]

K = "sglang-abort-test-secret-0123456789"
OTHER = "a-stranger-with-its-own-key-0123456"


def _refused(code: str, channel: str = "sglang_abort") -> float:
    m = default_metrics()
    return m.child(m.auth_refused, channel, code)._value.get()


class _Sender:
    def __init__(self):
        self.aborted: list[int] = []

    def poll(self, room):
        return RoomState.TRANSFERRING

    def abort(self, room, reason):
        self.aborted.append(room)


@pytest.fixture
def prefill():
    """A bare prefill manager: the Common PULL socket on 127.0.0.1 and its control loop."""
    ctx = zmq.Context.instance()
    mgr = object.__new__(KVBridgeKVManager)
    mgr.server_socket = ctx.socket(zmq.PULL)
    mgr.server_socket.setsockopt(zmq.LINGER, 0)
    mgr.rank_port = mgr.server_socket.bind_to_random_port("tcp://127.0.0.1")
    mgr.local_ip = "127.0.0.1"
    mgr.kv_sender = _Sender()
    mgr.kvb_keyring = Keyring(K)
    mgr._kvb_closed = threading.Event()
    t = threading.Thread(target=mgr._prefill_control_loop, daemon=True)
    t.start()
    yield mgr
    mgr._kvb_closed.set()
    t.join(2)
    mgr.server_socket.close(0)


def _receiver(room: int, rank_port: int, keyring) -> KVBridgeKVReceiver:
    """A bare decode receiver whose notices go to the prefill rank at 127.0.0.1:rank_port."""
    r = object.__new__(KVBridgeKVReceiver)
    r.kv_mgr = SimpleNamespace(kvb_keyring=keyring, enable_deferred_decode_kv_release=False, local_ip="127.0.0.1",
                               rank_port=1)
    r.bootstrap_room, r.init_time, r._abort_generation = room, None, None
    r.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": rank_port}]
    return r


def _push(port: int):
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s



def test_only_sealed_abort_notices_abort_a_room(prefill):
    before = {c: _refused(c) for c in ("unsigned", "unknown_key", "bad_tag", "replay")}
    push = _push(prefill.rank_port)
    try:
        push.send_multipart([b"ABORT", b"11"])  # SGLang's plain notice, from anyone
        push.send_multipart([b"ABORT", b"12", b"127.0.0.1", b"1"])
        wait_until(lambda: _refused("unsigned") >= before["unsigned"] + 2, 5.0, "unsigned refusal counted")
        # sealed with a key nobody configured
        _receiver(13, prefill.rank_port, Keyring(OTHER))._send_abort_notification()
        wait_until(lambda: _refused("unknown_key") >= before["unknown_key"] + 1, 5.0, "unknown_key refusal counted")
        # a notice sealed for another prefill rank, replayed to this one
        ring = Keyring(K)
        frames = [b"ABORT", b"14", b"127.0.0.1", b"1"]
        from kvbridge.adapters.sglang.manager import ABORT_DOMAIN, abort_seal_payload

        push.send_multipart(frames + [ring.seal(abort_seal_payload("127.0.0.1:1", frames), ABORT_DOMAIN)])
        wait_until(lambda: _refused("bad_tag") >= before["bad_tag"] + 1, 5.0, "bad_tag refusal counted")
        assert prefill.kv_sender.aborted == []
        # the honest one, from kvbridge's decode side: aborts; the same frames again do not
        _receiver(15, prefill.rank_port, Keyring(K))._send_abort_notification()
        wait_until(lambda: prefill.kv_sender.aborted == [15], 5.0, "aborted == [15]")
        sealed = frames[:1] + [b"16"] + frames[2:]
        sealed.append(ring.seal(abort_seal_payload(f"127.0.0.1:{prefill.rank_port}", sealed), ABORT_DOMAIN))
        push.send_multipart(sealed)
        push.send_multipart(sealed)  # replayed
        wait_until(lambda: _refused("replay") >= before["replay"] + 1, 5.0, "replay refusal counted")
        assert prefill.kv_sender.aborted == [15, 16]
        # a rotated key: a decode signing with the old key the prefill still accepts
        prefill.kvb_keyring = Keyring(K, ["sglang-abort-old-key-0123456789ab"])
        _receiver(17, prefill.rank_port, Keyring("sglang-abort-old-key-0123456789ab"))._send_abort_notification()
        wait_until(lambda: prefill.kv_sender.aborted == [15, 16, 17], 5.0, "aborted == [15, 16, 17]")
    finally:
        push.close()


def test_without_a_secret_plain_notices_still_work(prefill):
    prefill.kvb_keyring = None
    push = _push(prefill.rank_port)
    try:
        push.send_multipart([b"ABORT", b"21"])
        wait_until(lambda: prefill.kv_sender.aborted == [21], 5.0, "aborted == [21]")
    finally:
        push.close()


def _put(url: str, body) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_sglang_bootstrap_server_takes_only_sealed_registrations():
    import socket

    from kvbridge.adapters.sglang.bootstrap import KVBridgeKVBootstrapServer
    from kvbridge.common import bootstrap as BS

    with pytest.raises(ValueError, match="allow_insecure"):
        KVBridgeKVBootstrapServer("0.0.0.0", 1, keyring=None, allow_insecure=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ring = Keyring(K)
    KVBridgeKVBootstrapServer("127.0.0.1", port, keyring=ring, allow_insecure=False)
    url = f"http://127.0.0.1:{port}/route"
    rec = tiny_record(0)
    reg = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
           "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
           "rank_ip": "127.0.0.1", "rank_port": 5000, "page_size": 16, "kv_cache_dtype": "bfloat16", "kvbridge": rec}
    end = time.monotonic() + 10
    status = None
    while time.monotonic() < end:  # the server's thread may still be starting
        try:
            status = _put(url, {**reg, "rank_ip": "6.6.6.6"})
            break
        except OSError:
            time.sleep(0.1)
    before = _refused("unsigned", "rank_record")
    assert status == 401
    assert _put(url, BS.seal_record(reg, ring)) == 200
    body = BS.fetch_ranks(f"127.0.0.1:{port}", timeout_s=5, keyring=ring)
    (entry,) = body["ranks"]
    assert entry["rank_ip"] == "127.0.0.1" and entry["endpoint"] == "tcp://127.0.0.1:40000"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    q = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    with opener.open(f"{url}?{q}", timeout=5) as r:
        info = json.loads(r.read())
    assert BS.open_route_info(info, (0, 0, 0, 0), ring)["rank_port"] == 5000
    assert _refused("unsigned", "rank_record") >= before
