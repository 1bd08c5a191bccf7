"""Bootstrap servers and their readers against strangers (``kvbridge.common.bootstrap``).

- ``PUT /route`` without a seal, sealed with an unknown key, altered after sealing, or
  replayed: 401 naming why, counted (``channel="rank_record"``), nothing registered; the
  sealed registration beside them is taken;
- a reader with the deployment's keyring takes only sealed rank entries, as their seal
  carries them: a forged entry is dropped (never returned), an altered one is read as
  sealed; a rotated key is accepted;
- a routable bind without a secret refuses to start unless ``allow_insecure``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvbridge.common import bootstrap as BS
from kvbridge.common.auth import AuthError, Keyring
from kvbridge.common.rooms import default_metrics
from tests.helpers.kvhelpers import tiny_record

pytestmark = [pytest.mark.timeout(120)]

K1 = "bootstrap-test-secret-one-0123456789"
K2 = "bootstrap-test-secret-two-0123456789"
OTHER = "a-stranger-with-its-own-key-0123456"


def _refused(code: str, channel: str = "rank_record") -> float:
    m = default_metrics()
    return m.child(m.auth_refused, channel, code)._value.get()


def _record(i: int, endpoint: str | None = None) -> dict:
    return tiny_record(i, endpoint=endpoint)


def _put(address: str, body) -> tuple[int, str]:
    data = json.dumps(body).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(f"http://{address}/route", data=data, method="PUT"), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def srv():
    s = BS.BootstrapServer("127.0.0.1", 0, page_size=16, tp_size=2, keyring=Keyring(K1))
    yield s
    s.close()


def test_unsealed_registration_is_refused_and_the_sealed_one_taken(srv):
    ring = Keyring(K1)
    forged = {"attn_tp_rank": 1, "kvbridge": _record(1, "tcp://attacker:1")}
    before = {c: _refused(c) for c in ("unsigned", "unknown_key", "bad_tag", "replay")}
    assert _put(srv.address, forged)[0] == 401
    status, text = _put(srv.address, BS.seal_record(forged, Keyring(OTHER)))
    assert status == 401 and "unknown_key" in text
    reg = {"attn_tp_rank": 1, "kvbridge": _record(1)}
    altered = {**BS.seal_record(reg, ring), "kvbridge": _record(1, "tcp://attacker:1")}  # a rank's seal, body changed
    honest = BS.seal_record(reg, ring)
    assert _put(srv.address, altered)[0] == 401
    assert not srv._ranks
    assert _put(srv.address, honest) == (200, "OK")
    status, text = _put(srv.address, honest)  # replayed
    assert status == 401 and "replay" in text and "KVBRIDGE_SECRET" in text
    assert _refused("unsigned") == before["unsigned"] + 1
    assert _refused("unknown_key") == before["unknown_key"] + 1
    assert _refused("bad_tag") == before["bad_tag"] + 1
    assert _refused("replay") == before["replay"] + 1
    assert srv._ranks[(0, 0, 1, 0)]["endpoint"] == "tcp://127.0.0.1:40001"
    srv.register(0, _record(0))
    body = BS.fetch_ranks(srv.address, timeout_s=5, keyring=Keyring(K2, [K1]))  # a reader mid-rotation
    assert BS.endpoints_by_tp_rank(body) == ["tcp://127.0.0.1:40000", "tcp://127.0.0.1:40001"]
    assert all(BS.SEAL_FIELD not in r for r in body["ranks"])
    with pytest.raises(BS.BootstrapError, match="refused.*unknown_key"):
        BS.fetch_ranks(srv.address, timeout_s=0.5, keyring=Keyring(OTHER))


class _Fake(BaseHTTPRequestHandler):
    body: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        data = json.dumps(self.body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake():
    """A stranger's bootstrap server (or one in the middle): serves ``_Fake.body``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_reader_never_trusts_a_forged_or_altered_record(fake):
    ring = Keyring(K1)
    top = {"ready": True, "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16,
           "kv_cache_dtype": None}
    entry = {"dp_rank": 0, "cp_rank": 0, "tp_rank": 0, "pp_rank": 0, **_record(0), "rank_ip": "127.0.0.1",
             "rank_port": 1}
    # forged: no seal at all
    _Fake.body = {**top, "ranks": [{**entry, "endpoint": "tcp://attacker:1"}]}
    before = _refused("unsigned")
    with pytest.raises(BS.BootstrapError, match="refused"):
        BS.fetch_ranks(fake, timeout_s=0.5, keyring=ring)
    assert _refused("unsigned") > before
    # altered in flight: the plain endpoint changed, the seal kept: read as sealed
    sealed = BS.seal_record(entry, ring)
    _Fake.body = {**top, "ranks": [{**sealed, "endpoint": "tcp://attacker:1"}]}
    body = BS.fetch_ranks(fake, timeout_s=5, keyring=ring)
    assert BS.endpoints_by_tp_rank(body) == ["tcp://127.0.0.1:40000"]
    # no keyring: auth off, the entries as served
    assert BS.endpoints_by_tp_rank(BS.fetch_ranks(fake, timeout_s=5)) == ["tcp://attacker:1"]


def test_route_answers_are_bound_to_their_rank_slot():
    ring = Keyring(K1)
    info = {"rank_ip": "10.0.0.1", "rank_port": 5, "kvbridge": _record(0)}
    sealed = BS.seal_route_info(info, (0, 0, 0, 0), ring)
    opened = BS.open_route_info({**sealed, "rank_ip": "6.6.6.6", "kvbridge": _record(0, "tcp://attacker:1"),
                                 "pp_rank": 0}, (0, 0, 0, 0), ring)
    assert opened["rank_ip"] == "10.0.0.1" and opened["kvbridge"]["endpoint"] == "tcp://127.0.0.1:40000"
    with pytest.raises(AuthError, match="slot"):
        BS.open_route_info(BS.seal_route_info(info, (0, 0, 0, 0), ring), (0, 0, 1, 0), ring)
    with pytest.raises(AuthError) as e:
        BS.open_route_info(info, (0, 0, 0, 0), ring)
    assert e.value.code == "unsigned"


def test_a_routable_bind_needs_a_secret():
    with pytest.raises(ValueError, match="KVBRIDGE_SECRET.*allow_insecure"):
        BS.BootstrapServer("0.0.0.0", 0)
    BS.BootstrapServer("0.0.0.0", 0, allow_insecure=True).close()
    BS.BootstrapServer("0.0.0.0", 0, keyring=Keyring(K1)).close()
