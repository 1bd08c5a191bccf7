"""Control messages: exact round trips, and ProtocolError (never anything else) for
garbage, truncation, wrong types, unknown tags, wrong versions, oversize and absurd
values (auth is the frame's: tests/core/test_auth.py)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.kvhelpers import tiny_description

from kvbridge.common.protocol import (
    MAX_BLOCK_IDS,
    PROTOCOL_VERSION,
    Abort,
    Heartbeat,
    ProtocolError,
    TransferDone,
    TransferFailed,
    TransferRequest,
    decode,
    encode,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------- strategies

i63 = st.integers(0, 2**63 - 1)
tok = st.integers(0, 2**31 - 1)
secs = st.floats(0.0, 1e12, allow_nan=False, allow_infinity=False)
text = st.text(max_size=40)
# a real layout's description; the protocol checks types and bounds, not geometry
LAYOUT = tiny_description()
layouts = st.builds(lambda eng, nl, off: msgspec.structs.replace(LAYOUT, engine=eng, num_layers=nl, layer_offset=off),
                    st.text(max_size=20), st.integers(0, 2**62 - 1), st.integers(0, 2**62 - 1))


@st.composite
def requests(draw):
    blocks = draw(st.lists(st.integers(0, 2**31 - 1), max_size=64))
    tpb = draw(st.integers(1, 256))
    first = draw(st.integers(0, 2**20))
    stop = draw(st.integers(first, first + len(blocks) * tpb))
    start = draw(st.integers(first, stop))
    staged = draw(st.booleans())
    return TransferRequest(
        room=draw(i63),
        model=draw(text),
        layout=msgspec.structs.replace(draw(layouts), tokens_per_block=tpb),
        block_ids=blocks,
        first_token=first,
        token_start=start,
        token_stop=stop,
        session=draw(st.text(min_size=1, max_size=60)),
        receivers=draw(st.integers(1, 1 << 16)),
        staging_addr=draw(st.integers(1, 2**63 - 1)) if staged else 0,
        staging_bytes=draw(st.integers(1, 2**63 - 1)) if staged else 0,
        sent_at=draw(secs),
    )


codes = st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True)
messages = st.one_of(
    requests(),
    st.builds(TransferDone, room=i63, bytes=i63, segments=i63, plan=st.text(max_size=20), seconds=secs),
    st.builds(TransferFailed, room=i63, reason=st.text(max_size=200), code=codes),
    st.builds(Heartbeat, room=i63, sender=text),
    st.builds(Abort, room=i63, reason=st.text(max_size=200)),
)


def _request(**kw) -> TransferRequest:
    base = dict(
        room=7,
        model="llama-3-8b",
        layout=LAYOUT,
        block_ids=[3, 4, 9],
        first_token=0,
        token_start=16,
        token_stop=40,
        session="127.0.0.1:15555",
        sent_at=1.5,
    )
    base.update(kw)
    return TransferRequest(**base)


def _raw(msg, **override) -> bytes:
    """``msg`` as a plain msgpack map with fields overridden (no validation)."""
    d = msgspec.to_builtins(msg)
    d.update(override)
    return msgspec.msgpack.encode(d)


# ------------------------------------------------------------------------- round trips


@FAST
@given(messages)
def test_round_trip_is_exact(msg):
    data = encode(msg)
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    assert encode(back) == data
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg


def test_wire_format_is_a_tagged_map():
    d = msgspec.msgpack.decode(encode(Heartbeat(room=3, sender="decode-0")))
    assert d == {"type": "heartbeat", "version": PROTOCOL_VERSION, "room": 3, "sender": "decode-0", "incarnation": ""}


# ------------------------------------------------------------------------- fuzz: only ProtocolError


def _only_protocol_error(data) -> None:
    try:
        decode(data)
    except ProtocolError:
        return
    # Random input may rarely be a valid message; that is fine as long as nothing else raised.


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_else(data):
    _only_protocol_error(data)


@FAST
@given(messages, st.data())
def test_every_truncation_is_a_protocol_error(msg, data):
    enc = encode(msg)
    cut = data.draw(st.integers(0, len(enc) - 1))
    with pytest.raises(ProtocolError):
        decode(enc[:cut])


@FAST
@given(messages, st.data())
def test_flipped_bytes_never_raise_anything_else(msg, data):
    enc = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(enc) - 1))
        enc[i] = data.draw(st.integers(0, 255))
    _only_protocol_error(bytes(enc))


# A value of the wrong type for each kind of field (bool is not an int, an int is a float).
wire_int = st.integers(-(2**63), 2**64 - 1)
fraction = st.floats(-1e15, 1e15, allow_nan=False).filter(lambda f: f != int(f))
_WRONG = {
    bool: [wire_int, st.text(max_size=5), st.none(), st.lists(wire_int, max_size=2)],
    int: [st.text(max_size=5), st.booleans(), st.none(), st.lists(wire_int, max_size=2), fraction],
    float: [st.text(max_size=5), st.booleans(), st.none(), st.lists(wire_int, max_size=2)],
    str: [wire_int, st.booleans(), st.none(), st.floats(allow_nan=False), st.lists(st.text(), max_size=2)],
    list: [wire_int, st.text(max_size=5), st.none(), st.dictionaries(st.text(max_size=3), wire_int, max_size=2), st.lists(st.text(max_size=3), min_size=1, max_size=3)],
    dict: [wire_int, st.text(max_size=5), st.none(), st.lists(wire_int, max_size=2)],
}


def _kind(value) -> type:
    return next(k for k in (bool, int, float, str, list, dict) if isinstance(value, k))


@FAST
@given(messages, st.data())
def test_wrong_type_fields_are_protocol_errors(msg, data):
    plain = msgspec.to_builtins(msg)  # typed parts (a layout) as their wire form; None fields are not sent
    fields = [f for f in msg.__struct_fields__ if plain.get(f) is not None]
    name = data.draw(st.sampled_from(fields))
    kind = _kind(plain[name])
    bad = data.draw(st.one_of(_WRONG[kind]))
    with pytest.raises(ProtocolError):
        decode(_raw(msg, **{name: bad}))


@FAST
@given(messages, st.text(max_size=20).filter(lambda s: s not in {"transfer_request", "transfer_done", "transfer_failed", "heartbeat", "abort"}))
def test_unknown_type_tags_are_protocol_errors(msg, tag):
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(_raw(msg, type=tag))


def test_a_huge_unknown_tag_is_not_echoed_whole():
    with pytest.raises(ProtocolError) as e:
        decode(msgspec.msgpack.encode({"type": "x" * 100_000, "version": 1, "room": 1}))
    assert len(str(e.value)) < 300


def test_missing_tag_or_not_a_map():
    with pytest.raises(ProtocolError, match="not a kvbridge message"):
        decode(msgspec.msgpack.encode({"version": 1, "room": 1, "sender": "x"}))
    with pytest.raises(ProtocolError, match="not a kvbridge message"):
        decode(msgspec.msgpack.encode([1, 2, 3]))
    with pytest.raises(ProtocolError, match="must be bytes"):
        decode("heartbeat")  # type: ignore[arg-type]


# ------------------------------------------------------------------------- versions, size, values


@given(st.integers(0, 2**40).filter(lambda v: v != PROTOCOL_VERSION))
@FAST
def test_wrong_version_names_both_versions(v):
    with pytest.raises(ProtocolError) as e:
        decode(_raw(Heartbeat(room=1, sender="p"), version=v))
    assert f"version {v}" in str(e.value) and f"version {PROTOCOL_VERSION}" in str(e.value)


def test_version_is_checked_before_a_foreign_schema():
    # A future version with fields this side does not know still reports the version.
    future = PROTOCOL_VERSION + 1
    data = msgspec.msgpack.encode({"type": "transfer_request", "version": future, "room": "abc", "new_field": [1]})
    with pytest.raises(ProtocolError, match=f"version {future}.*version {PROTOCOL_VERSION}"):
        decode(data)


def test_size_cap():
    msg = Abort(room=1, reason="x" * 4000)
    data = encode(msg)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(data, max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)) == msg
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(msg, max_bytes=100)
    big = msgspec.msgpack.encode({"type": "abort", "version": PROTOCOL_VERSION, "room": 1, "reason": "y" * (17 << 20)})
    with pytest.raises(ProtocolError, match="exceeds the 16777216-byte limit"):
        decode(big)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"room": -1}, r"\$\.room"),
        ({"room": 2**64 - 1}, r"\$\.room"),
        ({"token_start": 30, "token_stop": 20}, "inverted"),
        ({"first_token": 17}, "inverted"),
        ({"token_stop": 49}, "cannot hold"),
        ({"block_ids": [1, -2]}, r"block_ids"),
        ({"block_ids": [2**40]}, r"block_ids"),
        ({"session": ""}, r"\$\.session"),
        ({"receivers": 0}, r"\$\.receivers"),
        ({"sent_at": -1.0}, r"\$\.sent_at"),
        ({"sent_at": float("inf")}, r"\$\.sent_at"),
        ({"sent_at": float("nan")}, r"\$\.sent_at"),
        ({"staging_addr": 4096}, "staging"),
        ({"staging_bytes": -5}, r"staging_bytes"),
        ({"layout": {str(i): i for i in range(300)}}, r"\$\.layout"),
        ({"layout": {**msgspec.to_builtins(LAYOUT), "num_blocks": True}}, r"\$\.layout\.num_blocks"),
        ({"layout": {**msgspec.to_builtins(LAYOUT), "head_dim": 2**62}}, r"\$\.layout\.head_dim"),
        ({"layout": {**msgspec.to_builtins(LAYOUT), "base": [[1, 2, 3]]}}, r"\$\.layout\.base"),
        ({"layout": {**msgspec.to_builtins(LAYOUT), "row_strides": [[0, 1]]}}, r"\$\.layout\.row_strides"),
        ({"layout": {**msgspec.to_builtins(LAYOUT), "extra": 1}}, r"\$\.layout"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_absurd_request_values(override, match):
    with pytest.raises(ProtocolError, match=match):
        decode(_raw(_request(), **override))


def test_absurd_values_in_other_messages():
    with pytest.raises(ProtocolError, match=r"\$\.bytes"):
        decode(_raw(TransferDone(room=1, bytes=1, segments=1, plan="direct", seconds=0.1), bytes=-1))
    with pytest.raises(ProtocolError, match=r"\$\.code"):
        decode(_raw(TransferFailed(room=1, reason="r", code="timeout"), code="Not A Code!"))
    with pytest.raises(ProtocolError, match=r"\$\.reason"):
        decode(_raw(Abort(room=1, reason="r"), reason="z" * 5000))


def test_too_many_block_ids():
    n = MAX_BLOCK_IDS + 1
    ids = msgspec.Raw(b"\xdd" + n.to_bytes(4, "big") + bytes(n))  # array32 of n zeros
    d = msgspec.to_builtins(_request())
    d["block_ids"] = ids
    data = msgspec.msgpack.encode(d)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(data)  # over the default 16 MiB cap already
    with pytest.raises(ProtocolError, match=r"length <= 16777216 - at `\$\.block_ids`"):
        decode(data, max_bytes=len(data))


def test_encode_refuses_invalid_messages():
    with pytest.raises(ProtocolError, match="refusing to send.*room"):
        encode(Heartbeat(room=-3, sender="x"))
    with pytest.raises(ProtocolError, match="refusing to send.*block_ids"):
        encode(_request(block_ids=[1, 2, -1]))
    with pytest.raises(ProtocolError, match="inverted"):  # cross-field checks run on construction
        _request(token_start=30, token_stop=20)
    with pytest.raises(ProtocolError, match="not a kvbridge message"):
        encode({"type": "heartbeat"})  # type: ignore[arg-type]
    # Without validation the peer is the one who refuses.
    with pytest.raises(ProtocolError):
        decode(encode(Heartbeat(room=-3, sender="x"), validate=False))
