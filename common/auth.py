"""Sealed frames: every kvbridge message that changes state, authenticated end to end.

With a shared secret configured, every frame kvbridge puts on a control socket (decode
<-> prefill), on the TensorRT-LLM bus, or into a bootstrap record is *sealed*:

    frame = MAGIC(4) | key id(4) | sent, unix ns(8) | nonce(8) | tag(32) | payload

``tag`` is HMAC-SHA256 under the key named by ``key id`` over a domain string (which
channel: ``b"control"``, ``b"bus"``, ``b"rank-record"``...), the header and the whole
payload: every field of every message is covered, and a frame sealed for one channel is
refused on another. ``Keyring.open`` checks, cheapest first and before anything decodes
the payload: the size, the magic, the key id, the time window (``window_s`` either side
of this host's clock: hosts need NTP), the tag (constant time), then the nonce (a frame
seen before inside the window is a replay). Each refusal raises ``AuthError`` with a
short ``code`` (``unsigned``, ``unknown_key``, ``stale``, ``bad_tag``, ``replay``) for the
caller's counter.

Key rotation: a keyring signs with its first secret and accepts all of them
(``secret`` plus ``accepted_secrets``): add the new key as accepted everywhere, make it
the signing key everywhere, then drop the old one. A key id is a hash of its key, never
the key; ``repr`` shows only ids.

Example::

    >>> ring = Keyring("0123456789abcdef0123456789abcdef")
    >>> ring.open(ring.seal(b"hello", b"control"), b"control")
    b'hello'
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable

__all__ = ["AuthError", "Keyring", "MIN_SECRET_BYTES", "OVERHEAD", "key_id", "check_secret"]

MAGIC = b"KVA1"
MIN_SECRET_BYTES = 16
_HEADER = struct.Struct("!4s4sqQ")  # magic, key id, sent (unix ns), nonce
_TAG = 32
OVERHEAD = _HEADER.size + _TAG
_DOMAIN = b"kvbridge-seal-v1\x00"


class AuthError(ValueError):
    """A frame refused by ``Keyring.open``; ``code`` names why in one word."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def key_id(secret: str | bytes) -> bytes:
    """The 4-byte id a sealed frame names its key by (a hash of the key, not the key)."""
    return hashlib.sha256(b"kvbridge-key-id\x00" + _key(secret)).digest()[:4]


def check_secret(secret: str | bytes, name: str = "secret") -> None:
    """Raise ValueError naming ``name`` when ``secret`` is shorter than MIN_SECRET_BYTES."""
    n = len(_key(secret))
    if n < MIN_SECRET_BYTES:
        raise ValueError(f"{name} is {n} bytes; at least {MIN_SECRET_BYTES} are required "
                         "(e.g. 32 random bytes: `openssl rand -hex 32`)")


class Keyring:
    """The keys one process seals with (the first) and accepts (all), with its replay
    window. Thread-safe; one per channel or shared, either works (nonces are random)."""

    def __init__(self, secret: str | bytes, accepted: Iterable[str | bytes] = (), *, window_s: float = 30.0,
                 max_nonces: int = 1 << 20, clock: Callable[[], float] = time.time):
        keys = [_key(secret)] + [_key(s) for s in accepted if s]
        for i, k in enumerate(keys):
            check_secret(k, "secret" if i == 0 else f"accepted_secrets[{i - 1}]")
        if window_s <= 0:
            raise ValueError(f"replay window must be positive, got {window_s}")
        self._keys = {key_id(k): k for k in keys}
        self._kid = key_id(keys[0])
        self._sign_key = keys[0]
        self.window_s = float(window_s)
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> forget after (local clock)
        self._max_nonces = int(max_nonces)
        self._lock = threading.Lock()
        self.evicted_nonces = 0  # nonces forgotten early because the cache was full

    def __repr__(self) -> str:
        return f"Keyring(key ids {[k.hex() for k in self._keys]}, signs with {self._kid.hex()}, window {self.window_s:g} s)"

    @property
    def key_ids(self) -> list[str]:
        return [k.hex() for k in self._keys]

    def _tag(self, key: bytes, domain: bytes, header: bytes, payload) -> bytes:
        h = hmac.new(key, _DOMAIN, hashlib.sha256)
        h.update(domain + b"\x00")
        h.update(header)
        h.update(payload)
        return h.digest()

    def seal(self, payload: bytes, domain: bytes) -> bytes:
        """``payload`` sealed for channel ``domain``."""
        header = _HEADER.pack(MAGIC, self._kid, int(self._clock() * 1e9), int.from_bytes(os.urandom(8), "big"))
        return header + self._tag(self._sign_key, domain, header, payload) + payload

    def open(self, frame, domain: bytes, max_bytes: int | None = None) -> bytes:
        """The payload of ``frame`` if it was sealed for ``domain`` by an accepted key,
        inside the window, and not seen before; else raise ``AuthError``."""
        view = memoryview(frame)
        if max_bytes is not None and view.nbytes > max_bytes + OVERHEAD:
            raise AuthError("too_large", f"frame of {view.nbytes} bytes exceeds the {max_bytes}-byte limit")
        if view.nbytes < OVERHEAD or bytes(view[:4]) != MAGIC:
            raise AuthError("unsigned", "frame is not sealed (no kvbridge seal: the peer has no secret, or is not kvbridge)")
        header = bytes(view[:_HEADER.size])
        _, kid, sent_ns, nonce = _HEADER.unpack(header)
        key = self._keys.get(kid)
        if key is None:
            raise AuthError("unknown_key", f"frame sealed with key id {kid.hex()}, not one of this side's "
                                           f"{self.key_ids} (a different secret, or a rotation not rolled out here)")
        now = self._clock()
        skew = sent_ns / 1e9 - now
        if abs(skew) > self.window_s:
            raise AuthError("stale", f"frame sealed {-skew:+.1f} s ago, outside the {self.window_s:g} s window "
                                     "(a replay, or clocks out of step: run NTP)")
        tag = bytes(view[_HEADER.size:OVERHEAD])
        payload = view[OVERHEAD:]
        if not hmac.compare_digest(tag, self._tag(key, domain, header, payload)):
            raise AuthError("bad_tag", "frame's tag does not match its content (altered; sealed for another "
                                       "channel or link, e.g. a prefill endpoint named differently on the two sides; "
                                       "or a different secret with a colliding key id)")
        nb = header[16:24] + kid
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nb in self._seen:
                raise AuthError("replay", f"frame with nonce {nonce:016x} was seen before (a replay)")
            while len(self._seen) >= self._max_nonces:
                self._seen.popitem(last=False)
                self.evicted_nonces += 1
            self._seen[nb] = now + 2 * self.window_s
        return bytes(payload)

    @classmethod
    def from_settings(cls, secret: str, accepted: Iterable[str] = (), window_s: float = 30.0) -> "Keyring | None":
        """A keyring for ``secret`` (None when it is empty: auth off)."""
        return cls(secret, accepted, window_s=window_s) if secret else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this host only."""
    import ipaddress

    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: str | bytes, allow_insecure: bool, what: str) -> None:
    """Refuse a routable bind of ``what`` without a secret (ValueError naming the settings)
    unless ``allow_insecure``; allowed, it says so loudly. Loopback binds always pass."""
    import logging

    if secret or is_loopback(host):
        return
    if not allow_insecure:
        raise ValueError(f"{what} would listen on {host}, reachable from other hosts, without a shared secret: set "
                         "`secret` (KVBRIDGE_SECRET, at least 16 bytes, the same on every prefill and decode) or, on "
                         "an isolated network only, `allow_insecure: true` (KVBRIDGE_ALLOW_INSECURE=1); see "
                         "docs/security.md")
    logging.getLogger("kvbridge.common.auth").warning(
        "INSECURE: %s listens on %s without a shared secret (allow_insecure is set): anyone who reaches it can steer "
        "or fake KV handoffs; see docs/security.md", what, host)
