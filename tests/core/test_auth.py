"""Sealed frames (kvbridge.common.auth): every byte covered, replays and stale frames
refused, two keys during a rotation, short keys refused, the secret never printed, and a
routable bind without a secret refused. Expected values come from the standard library's
hmac/hashlib, not from the code under test."""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.common import protocol as P
from kvbridge.common.auth import MIN_SECRET_BYTES, OVERHEAD, AuthError, Keyring, check_bind, is_loopback, key_id
from kvbridge.common.settings import BridgeSettings, ConfigError
from tests.helpers.kvhelpers import tiny_description

K1 = "k1-" + "a" * 29
K2 = "k2-" + "b" * 29
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


LINK = P.link("tcp://10.0.0.1:18500", to_prefill=True)  # a decode rank -> prefill rank connection


def _request(**kw) -> P.TransferRequest:
    f = dict(room=7, model="llama", layout=tiny_description(), block_ids=[3, 4, 9],
             first_token=0, token_start=0, token_stop=40, session="10.0.0.2:15555", sent_at=12.5)
    return P.TransferRequest(**{**f, **kw})


def test_seal_is_an_hmac_over_domain_header_and_payload():
    clock = Clock()
    ring = Keyring(K1, clock=clock)
    frame = ring.seal(b"payload", b"control")
    magic, kid, sent_ns, nonce = struct.unpack("!4s4sqQ", frame[:24])
    assert magic == b"KVA1" and kid == hashlib.sha256(b"kvbridge-key-id\x00" + K1.encode()).digest()[:4]
    assert sent_ns == int(clock.t * 1e9)
    want = hmac.new(K1.encode(), b"kvbridge-seal-v1\x00" + b"control\x00" + frame[:24] + b"payload",
                    hashlib.sha256).digest()
    assert frame[24:56] == want and frame[56:] == b"payload" and OVERHEAD == 56
    assert ring.open(frame, b"control") == b"payload"


@FAST
@given(st.binary(min_size=0, max_size=200), st.data())
def test_every_byte_is_covered(payload, data):
    """Any single byte changed anywhere in the frame (header, tag or payload) is refused."""
    ring = Keyring(K1)
    frame = bytearray(ring.seal(payload, b"control"))
    i = data.draw(st.integers(0, len(frame) - 1))
    frame[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(AuthError):
        ring.open(bytes(frame), b"control")


def test_each_field_of_a_message_is_covered():
    """The fields the old per-message tag left out (model, sent_at, an abort's reason) are
    covered now: a sealed request with any field changed is refused."""
    ring = Keyring(K1)
    frame = P.pack(_request(), ring, LINK)
    for field, value in [("model", "other"), ("sent_at", 99.0), ("room", 8), ("block_ids", [3, 4, 10])]:
        forged = P.encode(msgspec.structs.replace(_request(), **{field: value}))
        with pytest.raises(AuthError, match="tag"):
            ring.open(frame[:OVERHEAD] + forged, LINK)
    assert P.unpack(frame, ring, LINK) == _request()


def test_unsigned_unknown_key_and_wrong_domain_are_refused():
    ring = Keyring(K1)
    with pytest.raises(AuthError) as e:
        P.unpack(P.pack(_request()), ring, LINK)  # a peer without a secret
    assert e.value.code == "unsigned"
    with pytest.raises(AuthError) as e:
        P.unpack(P.pack(_request(), Keyring(K2), LINK), ring, LINK)
    assert e.value.code == "unknown_key" and key_id(K2).hex() in str(e.value)
    with pytest.raises(AuthError) as e:
        ring.open(ring.seal(b"x", b"bus"), b"control")  # sealed for another channel
    assert e.value.code == "bad_tag"


def test_a_control_frame_is_bound_to_its_direction_and_its_prefill_rank():
    """A frame sealed for one link (direction, prefill rank) is refused on every other:
    a decode's request captured on its way to one prefill rank, replayed to another that
    shares the secret; a prefill rank's answer slipped into a decode's connection to
    another rank; a decode's frame reflected back at a decode as if a prefill sent it."""
    ring = Keyring(K1)
    a, b = "tcp://10.0.0.1:18500", "tcp://10.0.0.2:18500"
    to_a = P.pack(_request(), ring, P.link(a, to_prefill=True))
    assert P.unpack(to_a, ring, P.link(a, to_prefill=True)) == _request()
    from_b = P.pack(P.Heartbeat(room=3, sender=b, incarnation="b" * 16), ring, P.link(b, to_prefill=False))
    for frame, domain in [(to_a, P.link(b, to_prefill=True)), (to_a, P.link(a, to_prefill=False)),
                          (from_b, P.link(a, to_prefill=False)), (from_b, P.link(b, to_prefill=True))]:
        with pytest.raises(AuthError) as e:
            Keyring(K1).open(frame, domain)  # a fresh replay cache: the domain alone refuses it
        assert e.value.code == "bad_tag", domain
    with pytest.raises(ValueError, match="link"):
        P.pack(_request(), ring)  # sealing without saying for which link is a bug, named


def test_replay_is_refused_and_the_window_bounds_the_cache():
    clock = Clock()
    ring = Keyring(K1, window_s=30, clock=clock)
    frame = ring.seal(b"abort room 5", b"control")
    assert ring.open(frame, b"control") == b"abort room 5"
    with pytest.raises(AuthError) as e:
        ring.open(frame, b"control")
    assert e.value.code == "replay"
    clock.t += 31  # outside the window: refused as stale, and its nonce is no longer needed
    with pytest.raises(AuthError) as e:
        ring.open(frame, b"control")
    assert e.value.code == "stale"
    clock.t += 60
    ring.open(ring.seal(b"y", b"control"), b"control")
    assert len(ring._seen) == 1  # the old nonce expired
    future = Keyring(K1, clock=Clock(clock.t + 45)).seal(b"z", b"control")
    with pytest.raises(AuthError, match="NTP"):
        ring.open(future, b"control")


def test_nonce_cache_is_capped():
    ring = Keyring(K1, max_nonces=4)
    for _ in range(10):
        ring.open(ring.seal(b"x", b"control"), b"control")
    assert len(ring._seen) == 4 and ring.evicted_nonces == 6


def test_rotation_accepts_both_keys_and_signs_with_the_first():
    old, new = Keyring(K1), Keyring(K2)
    rolling = Keyring(K2, [K1])
    assert rolling.open(old.seal(b"a", b"control"), b"control") == b"a"
    assert rolling.open(new.seal(b"b", b"control"), b"control") == b"b"
    with pytest.raises(AuthError, match="unknown_key|not one of"):
        old.open(rolling.seal(b"c", b"control"), b"control")  # old-only peers do not take the new key yet


def test_short_keys_are_refused_and_the_secret_is_never_printed():
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES}"):
        Keyring("short")
    with pytest.raises(ConfigError, match=r"accepted_secrets\[0\] is 3 bytes"):
        BridgeSettings(secret=K1, accepted_secrets="abc")
    with pytest.raises(ConfigError, match="secret is 5 bytes"):
        BridgeSettings.load(environ={"KVBRIDGE_SECRET": "short"})
    s = BridgeSettings.load(environ={"KVBRIDGE_SECRET": K1, "KVBRIDGE_ACCEPTED_SECRETS": f"{K2}, "})
    assert s.accepted_list == (K2,)
    for obj in (s, s.handoff(), s.keyring()):
        assert K1 not in repr(obj) and K2 not in repr(obj) and K1 not in str(obj)
    assert key_id(K1).hex() in repr(s.keyring())


def test_routable_bind_without_a_secret_is_refused():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node-7")
    check_bind("127.0.0.1", "", False, "x")  # loopback: fine
    check_bind("10.1.2.3", K1, False, "x")  # a secret: fine
    with pytest.raises(ValueError, match="KVBRIDGE_SECRET.*allow_insecure"):
        check_bind("10.1.2.3", "", False, "the sender's control endpoint")
    check_bind("10.1.2.3", "", True, "x")  # allowed, loudly


def test_a_sender_refuses_a_routable_bind_without_a_secret():
    """At start, naming the setting; with allow_insecure or a secret it starts."""
    from prometheus_client import CollectorRegistry

    from kvbridge.common.handoff import HandoffFailed, KVSender
    from kvbridge.common.metrics import KVBridgeMetrics
    from kvbridge.common.transport import MooncakeTransport
    from kvbridge.layout.pools import allocate_pool

    lay = allocate_pool("sglang", layers=1, total_heads=1, head_dim=16, dtype="bf16", tokens_per_block=16,
                        num_blocks=4, tp_size=1, tp_rank=0, seed=3)
    t = MooncakeTransport("127.0.0.1")
    kw = dict(host="0.0.0.0", metrics=KVBridgeMetrics(CollectorRegistry()))
    try:
        with pytest.raises(HandoffFailed, match="KVBRIDGE_SECRET"):
            KVSender(lay, t, config=BridgeSettings().handoff(), **kw)
        KVSender(lay, t, config=BridgeSettings(allow_insecure=True).handoff(), **kw).close()
        KVSender(lay, t, config=BridgeSettings(secret=K1).handoff(), **kw).close()
    finally:
        t.close()
