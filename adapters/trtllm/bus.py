"""Messages on a TensorRT-LLM server's kvbridge bus (rank 0's scheduler socket).

Who speaks: the workers of every rank (``Hello``, ``LoadResult``, ``Released``), the scheduler
(``Orders``, ``Endpoints``), other kvbridge peers asking for this server's ranks
(``Who``), and routers telling a server which handoff a coming request belongs to
(``Expect``, answered by ``Expected``). msgpack on the wire, one frame per message;
msgspec checks every field while decoding (types, bounds, unknown fields refused), and
a message of another bus version is refused by name.

Orders (``kvbridge.common.orders``: ``Open``, ``Load``, ``Send``, ``Verdict``, ``Decline``,
``Drop``) travel in ``Orders`` and in the connector metadata TensorRT-LLM broadcasts; each
carries a sequence number and is applied once per rank, from whichever copy arrives first.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from kvbridge.common.handles import Handle
from kvbridge.common.orders import (Decline, Drop, Endpoint, EndpointList, Load, Open, Order, Reason, Send, SendLayers,
                                    Verdict)
from kvbridge.common.protocol import RankRecord

__all__ = [
    "BusError", "Decline", "Drop", "Endpoints", "Expect", "Expected", "Hello", "LoadResult", "Load", "Open",
    "Order", "Orders", "Released", "Send", "SendLayers", "Verdict", "Who", "decode", "encode", "BUS_VERSION",
]

BUS_VERSION = 2
MAX_BUS_BYTES = 64 << 20

ReqId = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # TensorRT-LLM's request ids are ints
Key = Annotated[str, Meta(min_length=32, max_length=32, pattern=r"^[0-9a-f]{32}$")]


class BusError(ValueError):
    """A bus message that cannot be decoded or is not valid; ``answer``: what to tell its
    sender (an announcement whose handle is not valid gets an ``Expected`` naming why)."""

    def __init__(self, message: str, answer: Any = None):
        super().__init__(message)
        self.answer = answer


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="t"):
    v: Annotated[int, Meta(ge=0, le=0xFFFF)] = BUS_VERSION


# -- bus messages -----------------------------------------------------------------------


class Orders(_Base, tag="orders", frozen=True, kw_only=True):
    orders: Annotated[list[Order], Meta(max_length=1 << 16)]


class Hello(_Base, tag="hello", frozen=True, kw_only=True):
    """A worker joined: its rank, its sender's control endpoint, its bootstrap record."""

    rank: Annotated[int, Meta(ge=0, le=1 << 16)]
    endpoint: Endpoint
    record: RankRecord | None = None


class LoadResult(_Base, tag="result", frozen=True, kw_only=True):
    """A worker's outcome of a load order."""

    req: ReqId
    rank: Annotated[int, Meta(ge=0, le=1 << 16)]
    ok: bool
    reason: Reason = ""


class Released(_Base, tag="released", frozen=True, kw_only=True):
    """A worker let go of a request's blocks: its sender's room for a prefill half is over
    (sent, failed or declined), or a load it held past the engine's free is quiet. Rank 0
    wakes an executor that waits for requests while every rank's blocks wait for it
    (``idle.IdleWake``)."""

    req: ReqId
    rank: Annotated[int, Meta(ge=0, le=1 << 16)]


class Who(_Base, tag="who", frozen=True, kw_only=True):
    """Another server asks for this server's ranks (answered with ``Endpoints``)."""


class Endpoints(_Base, tag="endpoints", frozen=True, kw_only=True):
    endpoints: EndpointList


class Expect(_Base, tag="expect", frozen=True, kw_only=True):
    """A router: the next request whose prompt hashes to ``key`` (``handle.prompt_key``)
    belongs to the handoff ``handle``, for ``ttl_s`` seconds."""

    key: Key
    handle: Handle
    ttl_s: Annotated[float, Meta(gt=0.0, le=86400.0)] = 60.0
    nonce: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0


class Expected(_Base, tag="expected", frozen=True, kw_only=True):
    """The answer to ``Expect``: ``ok``, or why not."""

    key: Key
    ok: bool
    nonce: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    reason: Reason = ""


Message = Union[Orders, Hello, LoadResult, Released, Who, Endpoints, Expect, Expected]
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


class _Envelope(msgspec.Struct):
    t: str
    v: int = BUS_VERSION


class _ExpectHead(msgspec.Struct):
    """What an announcement must carry to be answered at all."""

    key: Key
    nonce: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0


_env = msgspec.msgpack.Decoder(_Envelope)
_expect_head = msgspec.msgpack.Decoder(_ExpectHead)


def encode(msg: Any) -> bytes:
    """``msg`` as bus bytes."""
    return _enc.encode(msg)


def decode(data: bytes) -> Any:
    """The bus message in ``data``; BusError naming what is wrong."""
    if len(data) > MAX_BUS_BYTES:
        raise BusError(f"bus message of {len(data)} bytes exceeds {MAX_BUS_BYTES}")
    try:
        env = _env.decode(data)
    except Exception as e:
        raise BusError(f"not a kvbridge bus message: {e}") from None
    if env.v != BUS_VERSION:
        raise BusError(f"peer speaks kvbridge bus version {env.v}, this side speaks {BUS_VERSION}")
    try:
        return _dec.decode(data)
    except msgspec.ValidationError as e:
        answer = None
        if env.t == "expect":  # the announcer is told why, not left to time out
            try:
                head = _expect_head.decode(data)
                answer = Expected(key=head.key, ok=False, nonce=head.nonce, reason=f"invalid announcement: {e}")
            except msgspec.MsgspecError:
                pass
        raise BusError(f"invalid {env.t!r} bus message: {e}", answer) from None
    except Exception as e:
        raise BusError(f"malformed {env.t!r} bus message: {e}") from None


# -- sealed frames (kvbridge.common.auth): with a secret every bus message is sealed ------

DOMAIN = b"bus"  # a frame sealed for the control channel or a rank record is refused here


def pack(msg: Any, keyring=None) -> bytes:
    """``msg`` as bus bytes, sealed with ``keyring`` (a ``Keyring``; None: auth off)."""
    data = encode(msg)
    return keyring.seal(data, DOMAIN) if keyring is not None else data


def unpack(data: bytes, keyring=None) -> Any:
    """The bus message in ``data``: its seal checked first (``AuthError``), then decoded
    (``BusError``)."""
    if keyring is not None:
        data = keyring.open(data, DOMAIN, MAX_BUS_BYTES)
    return decode(data)


def receive(payload: bytes, keyring, limiter, peer: str, reply: Any = None) -> Any:
    """The bus message in ``payload``, or None when it is refused: counted in
    ``kvbridge_refused_frames_total{channel="bus"}``, logged at ``limiter``'s rate; a
    sealed one that is not valid is answered through ``reply(msg)`` where it has an
    answer (``BusError.answer``)."""
    from kvbridge.common.auth import AuthError
    from kvbridge.common.rooms import default_metrics

    try:
        return unpack(payload, keyring)
    except (AuthError, BusError) as e:
        code = getattr(e, "code", "bad_message")
        default_metrics().refused("bus", code)
        limiter.warn(code, "from %s: %s", peer, e)
        if reply is not None and getattr(e, "answer", None) is not None:
            reply(e.answer)
        return None
