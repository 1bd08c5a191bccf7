"""Hostile input: fuzzed control messages, and a hostile peer against a real handoff.

(a) Every message type decoded from fuzzed bytes (truncated, oversized, wrong types,
wrong or unknown versions and tags, huge ints, negative and NaN values, unknown fields)
either decodes to a valid message or raises ``ProtocolError`` naming the problem; a
layout description off the wire either rebuilds or raises ``LayoutError``.

(b) A REAL ``KVSender`` (prefill process) and ``KVReceiver`` (decode process) over ZMQ
and Mooncake TCP on 127.0.0.1, with a raw ZMQ DEALER in this process as the hostile
peer: fuzzed, replayed, out-of-order and cross-room messages, block ids outside the
room or the pool, token ranges past the end, the victim's valid transfer session
unsealed, sealed with a wrong key, tampered, stale or replayed (each refused before
it is decoded, counted in ``kvbridge_refused_frames``, answered at most with a bare
rate-limited refusal), and requests
sealed by a peer that holds the secret but is wrong anyway (refused with a reason sent
back). The prefill process never crashes or hangs (every frame is followed by a sealed
ping answered within a bound), no byte of the decode pool
outside the room's blocks changes (the whole pool is compared with a snapshot), and
the legitimate handoff that was waiting all along then succeeds byte-exact.

Example counts: ``KVBRIDGE_FUZZ_EXAMPLES`` (default: small, for CI) sets them for every
hypothesis test here, e.g. ``KVBRIDGE_FUZZ_EXAMPLES=500 pytest tests/hostile/test_hostile_input.py``.
"""

from __future__ import annotations

import itertools
import os
import re
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tests.helpers import hostile_peers
from tests.helpers.handoff_peers import build_pool
from kvbridge.common import protocol as P
from kvbridge.common.auth import OVERHEAD, Keyring
from kvbridge.common.control import ControlChannel
from kvbridge.layout import KVLayout, LayoutError
from tests.helpers.kvhelpers import PipePeer

_N = int(os.environ.get("KVBRIDGE_FUZZ_EXAMPLES", "0"))
settings.register_profile("kvbridge-fuzz-ci", max_examples=60, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("kvbridge-fuzz-local", max_examples=max(_N, 1), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings.get_profile("kvbridge-fuzz-local" if _N else "kvbridge-fuzz-ci")
# examples that go through the real peers cost a few round trips each
PEER_FUZZ = settings(FUZZ, max_examples=_N or 25)

SECRET = "hostile-test-secret-0123456789abcdef"
RING = Keyring(SECRET)  # what a peer holding the secret seals with
WRONG = Keyring("not-the-secret-" + "x" * 24)


def to_prefill(endpoint: str) -> bytes:
    """The seal domain of frames sent to the prefill rank at ``endpoint``."""
    return P.link(endpoint, to_prefill=True)


def from_prefill(endpoint: str) -> bytes:
    """The seal domain of frames the prefill rank at ``endpoint`` sends."""
    return P.link(endpoint, to_prefill=False)
CFG = dict(deadline_s=120.0, heartbeat_s=0.2, peer_timeout_s=30.0, quiesce_s=1.0, chunk_bytes=1 << 20)
REPLY_S = 10.0  # every hostile frame is answered (or the ping after it is) within this

# -- (a) decoding fuzzed bytes ------------------------------------------------------------------

LAY = build_pool(dict(engine="trtllm", layers=2, total_heads=4, tp=1, rank=0, head_dim=32, dtype="bf16", tpb=16,
                      blocks=8, seed=1))[0]


def _valid_messages():
    req = P.TransferRequest(room=5, model="m", layout=P.LayoutDescription.of(LAY), block_ids=[1, 2, 3], first_token=0,
                            token_start=0, token_stop=40, session="127.0.0.1:15001", sent_at=1.0)
    done = P.TransferDone(room=5, bytes=10, segments=1, plan="direct", seconds=0.1, aux={"output_ids": [3]},
                          src_layout=P.LayoutDescription.of(LAY),
                          staged=[P.StagedChunk(first_token=0, start=0, stop=16, offset=0, blocks=[1])])
    return [req, done, P.TransferFailed(room=5, reason="x", code="timeout"),
            P.Heartbeat(room=5, sender="tcp://x"), P.Abort(room=5, reason="r")]


VALID = _valid_messages()
HOSTILE_VALUES = st.one_of(
    st.sampled_from([2**64 - 1, 2**63, -(2**63), -1, 2**31, float("nan"), float("inf"), -0.0, True, None, "", "x" * 5000,
                     b"\x00\xff", [], {}, [[[]]], {"a": {"b": []}}]),
    st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=40), st.binary(max_size=40),
    st.lists(st.integers(-(2**40), 2**40), max_size=8),
)


@st.composite
def mutated(draw):
    """(wire bytes, the field that was changed or None) from a valid message with one change."""
    msg = draw(st.sampled_from(VALID))
    d = msgspec.to_builtins(msg)
    field = draw(st.sampled_from(sorted(d) + ["<unknown>", "<drop>"]))
    if field == "<unknown>":
        d["zz_" + draw(st.text(max_size=8))] = draw(HOSTILE_VALUES)
    elif field == "<drop>":
        field = draw(st.sampled_from(sorted(d)))
        del d[field]
    else:
        d[field] = draw(HOSTILE_VALUES)
    return msgspec.msgpack.encode(d), field


# fields that checks comparing fields (TransferRequest's and TransferDone's __post_init__) name in their message
_CROSS_FIELD = {"first_token", "token_start", "token_stop", "staging_addr", "staging_bytes", "block_ids", "layout",
                "layer_bytes"}


@FUZZ
@given(mutated())
def test_one_changed_field_decodes_or_is_named(case):
    data, field = case
    try:
        msg = P.decode(data)
    except P.ProtocolError as e:
        text = str(e)
        assert text and len(text) < 2000
        if field == "<unknown>":
            assert "unknown field `zz_" in text, text
        elif field not in (None, "type", "version"):
            # msgspec names the path (`$.field`) or the missing field; a cross-field check names
            # the fields it compares
            path = f"$.{field}"
            named = any(path + end in text for end in ("`", "[", "."))  # the field, or an element inside it
            assert named or f"field `{field}`" in text or (field in _CROSS_FIELD and field in text), (field, text)
        return
    assert isinstance(msg, tuple(P._TYPES.values()))
    P.encode(msg)  # a message that decodes is one we could send back unchanged


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_truncated_and_padded_messages(msg, data):
    wire = P.encode(msg)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(P.ProtocolError):
        P.decode(wire[:cut])
    with pytest.raises(P.ProtocolError):
        P.decode(wire + data.draw(st.binary(min_size=1, max_size=16)))


@FUZZ
@given(st.sampled_from(VALID), st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.none(),
                                         st.floats(allow_nan=True)))
def test_wrong_versions_are_named(msg, version):
    d = msgspec.to_builtins(msg)
    d["version"] = version
    if version == P.PROTOCOL_VERSION and type(version) is int:
        return
    with pytest.raises(P.ProtocolError, match="version|not a kvbridge message|malformed"):
        P.decode(msgspec.msgpack.encode(d))


def test_a_layout_off_the_wire_names_its_memory():
    """A request whose layout names no memory regions is refused at decode: without them no
    address the map names could be checked before a byte moves."""
    d = msgspec.to_builtins(_valid_messages()[0])
    d["layout"]["regions"] = []
    with pytest.raises(P.ProtocolError, match=r"\$\.layout\.regions"):
        P.decode(msgspec.msgpack.encode(d))


def test_oversized_messages_are_refused_before_parsing():
    big = b"\x91" + b"\xc4\x00" * (P.MAX_MESSAGE_BYTES // 2 + 1)
    with pytest.raises(P.ProtocolError, match="exceeds the .*-byte limit"):
        P.decode(big)


@st.composite
def layout_descriptions(draw):
    d = LAY.describe()
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(d) + ["tensors", "zz"]))
        if draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = draw(HOSTILE_VALUES)
    return d


@FUZZ
@given(layout_descriptions())
def test_layout_descriptions_off_the_wire_rebuild_or_raise_layout_error(d):
    try:
        lay = KVLayout.from_description(d)
    except LayoutError as e:
        assert str(e)
        return
    assert lay.num_blocks > 0 and lay.tensors is None


# -- the control channel itself ----------------------------------------------------------------


def test_control_channel_refuses_spoofed_routing_ids_and_oversized_frames():
    """A DEALER that sends [another peer's routing id, payload] must not be taken for that
    peer; a frame past the size cap drops its connection instead of being buffered."""
    got = []
    ch = ControlChannel(lambda peer, payload: got.append((peer, payload)), bind_host="127.0.0.1",
                        max_message_bytes=1 << 16)
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.ROUTING_ID, b"mallory")
    ok = ctx.socket(zmq.DEALER)
    ok.setsockopt(zmq.LINGER, 0)
    try:
        d.connect(ch.endpoint)
        ok.connect(ch.endpoint)
        d.send_multipart([b"\x00victim", b"payload"])
        d.send(b"x" * (1 << 17))
        ok.send(b"after")
        # two connections: the router may read either first, so wait for both the good
        # peer's message and the spoofed one's refusal
        end = time.monotonic() + 10
        while not (any(p == b"after" for _, p in got) and ch.refused_frames) and time.monotonic() < end:
            time.sleep(0.01)
        assert [p for _, p in got] == [b"after"], got
        assert b"\x00victim".hex() not in {peer for peer, _ in got}
        assert ch.refused_frames == 1
    finally:
        d.close(0)
        ok.close(0)
        ch.close()


# -- (b) a hostile peer against real peers -----------------------------------------------------


def Peer(target, spec, cfg):
    return PipePeer(target, spec, {**CFG, **cfg}, ready_timeout=90)


def _spec(engine, tpb, seed, blocks=64):
    return dict(engine=engine, layers=2, total_heads=4, tp=1, rank=0, head_dim=32, dtype="bf16", tpb=tpb, blocks=blocks,
                seed=seed)


@pytest.fixture(scope="module")
def pair():
    pre = Peer(hostile_peers.prefill_main, _spec("sglang", 16, 71, blocks=256), {"secret": SECRET})
    dec = Peer(hostile_peers.decode_main, _spec("trtllm", 32, 72), {"secret": SECRET, "recv_staging_bytes": 1 << 20})
    yield pre, dec
    pre.stop()
    dec.stop()


class Hostile:
    """A raw DEALER: sends anything, pings after it (sealed: only an authenticated ping is
    answered), collects every reply (sealed with the secret)."""

    _pings = itertools.count(1 << 40)

    def __init__(self, endpoint: str, routing_id: bytes | None = None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def exchange(self, frame: bytes) -> list:
        """Send ``frame``, then a ping; the decoded replies that came before the ping's echo."""
        ping = next(self._pings)
        self.sock.send(frame)
        self.sock.send(P.pack(P.Heartbeat(room=ping, sender="hostile"), RING, to_prefill(self.endpoint)))
        replies, end = [], time.monotonic() + REPLY_S
        while time.monotonic() < end:
            if not self.sock.poll(100):
                continue
            m = P.unpack(self.sock.recv(), RING, from_prefill(self.endpoint))
            if isinstance(m, P.Heartbeat) and m.room == ping:
                return replies
            replies.append(m)
        raise AssertionError(f"the prefill did not answer a ping within {REPLY_S} s after a hostile frame (hung?)")

    def close(self):
        self.sock.close(0)


def _request_dict(room, session, layout, blocks, n, **over):
    d = dict(type="transfer_request", version=P.PROTOCOL_VERSION, room=room, model="", layout=layout,
             block_ids=list(blocks), first_token=0, token_start=0, token_stop=n, session=session, receivers=1,
             staging_addr=0, staging_bytes=0, sent_at=time.time())
    d.update(over)
    return d


def _sealed(d, endpoint: str, ring=RING) -> bytes:
    """``d`` msgpack-encoded as is (valid or not) and sealed by ``ring``: what a peer
    holding that key can send."""
    return ring.seal(msgspec.msgpack.encode(d), to_prefill(endpoint))


@st.composite
def hostile_frames(draw, endpoint, room, session, layout, room_blocks, n, nblocks):
    """(wire bytes, why it must be refused) of one frame from a peer without the secret,
    aimed at the waiting room (or another one)."""
    kind = draw(st.sampled_from(["garbage", "request", "request", "other", "version"]))
    if kind == "garbage":
        return draw(st.binary(max_size=256)), "unsigned"
    target = draw(st.sampled_from([room, room, room + 1, draw(st.integers(0, 2**63 - 1))]))
    if kind == "other":
        cls = draw(st.sampled_from([P.TransferDone, P.TransferFailed, P.Abort, P.Heartbeat]))
        fill = {P.TransferDone: dict(bytes=1, segments=1, plan="direct", seconds=0.0),
                P.TransferFailed: dict(reason="no", code="timeout"), P.Abort: dict(reason="stop"),
                P.Heartbeat: dict(sender="x")}[cls]
        body = P.encode(cls(room=target, **fill))
    else:
        blocks = draw(st.one_of(
            st.just(room_blocks),                                            # the room's own blocks
            st.lists(st.integers(0, nblocks - 1), max_size=8),               # another room's / free blocks
            st.lists(st.integers(-5, 2**31 - 1), min_size=1, max_size=8),    # outside the pool
        ))
        stop = draw(st.sampled_from([n, n + 1, 10**6, 2**31 - 1, 0]))
        d = _request_dict(target, draw(st.sampled_from([session, "127.0.0.1:1", ""])), layout, blocks, stop,
                          token_start=draw(st.sampled_from([0, 1, stop])))
        if kind == "version":
            d["version"] = draw(st.sampled_from([0, 2, 65535, -1, "1"]))
        body = msgspec.msgpack.encode(d)
    how = draw(st.sampled_from(["unsigned", "unknown_key", "bad_tag", "stale", "moved_tag"]))
    if how == "unsigned":
        return body, how
    if how == "unknown_key":
        return WRONG.seal(body, to_prefill(endpoint)), how
    if how == "stale":  # sealed by the right key, a minute ago
        return Keyring(SECRET, clock=lambda: time.time() - 60).seal(body, to_prefill(endpoint)), how
    genuine = RING.seal(body, to_prefill(endpoint))
    if how == "moved_tag":  # a genuine header and tag, over another frame's content
        other = RING.seal(P.encode(P.Abort(room=target, reason="x")), to_prefill(endpoint))
        return genuine[:OVERHEAD] + other[OVERHEAD:], "bad_tag"
    i = draw(st.integers(0, len(genuine) - 1))  # one byte changed anywhere
    flipped = bytearray(genuine)
    flipped[i] ^= draw(st.integers(1, 255))
    return bytes(flipped), None  # refused; which check says so depends on the byte


def _only_refusals(replies) -> bool:
    """Nothing but the rate-limited bare refusal (room 0, code ``auth``) came back."""
    return all(isinstance(m, P.TransferFailed) and (m.room, m.code) == (0, "auth") for m in replies)


def _refused(peer) -> dict:
    return peer.call("refused")[1]


def test_hostile_dealer_without_the_secret_is_refused_and_writes_nothing(pair):
    pre, dec = pair
    endpoint, free0 = pre.ready[1], pre.ready[2]
    session, dfree0, layout = dec.ready[1], dec.ready[2], dec.ready[3]
    room, n = 4242, 100
    src_blocks = pre.call("register", room, n)[1]
    dst_blocks = dec.call("start_pull", room, [endpoint], n, {"deadline_s": 120})[1]
    dec.call("snap", "before")
    pre.call("logs")
    hostile = Hostile(endpoint)
    try:
        @PEER_FUZZ
        @given(hostile_frames(endpoint, room, session, layout, dst_blocks, n, 64))
        def attack(case):
            frame, why = case
            before = _refused(pre)
            replies = hostile.exchange(frame)
            after = _refused(pre)
            grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            # refused before it was decoded: counted once; answered at most with the bare refusal
            # (rate-limited: a decode with another key learns why), never with anything of a room
            assert sum(grew.values()) == 1 and _only_refusals(replies), (why, grew, replies)
            if why is not None:
                assert grew == {f"control/{why}": 1}, (why, grew)
            # no byte of the decode pool changed: the room's KV is not even computed yet
            assert dec.call("changed", "before", [])[1] == 0

        attack()
        logs = [t for _, t in pre.call("logs")[1]]
        # a flood of refusals costs a log line per reason per second, not one per frame
        assert 0 < len([t for t in logs if "refused control frames" in t]) < 20, logs
        assert pre.call("ping")[0] == "pong" and dec.call("ping")[0] == "pong"
        # a captured request (sealed with the secret), sent twice: the first is refused as a
        # conflict (the decode rank's own request for the room came first), the second as a replay
        captured = _sealed(_request_dict(room, session, layout, dst_blocks, n), endpoint)
        replies = hostile.exchange(captured)
        assert [m.code for m in replies if isinstance(m, P.TransferFailed)] == ["conflict"], replies
        before = _refused(pre)
        assert _only_refusals(hostile.exchange(captured))
        assert _refused(pre).get("control/replay", 0) == before.get("control/replay", 0) + 1
    finally:
        hostile.close()
    # the legitimate handoff that waited through all of it: byte-exact, nothing else in the pool touched
    pre.call("compute", room)
    state = dec.call("wait", room, 30)
    assert state[1] == "SUCCESS", state[2]
    ok, changed = dec.call("verify", dst_blocks, n, pre.spec, src_blocks, "before")[1:]
    assert ok and changed == 0
    assert pre.call("state", room, 10)[1] == "SUCCESS"
    assert pre.call("free")[1:] == (free0, 0)
    assert dec.call("free")[1:] == (dfree0, 0)


def _still_describes_the_pool(layout: dict, key: str, value, blocks: list[int], n: int) -> bool:
    """Whether ``layout`` with ``key`` set to ``value`` is still a true (if partial) account of the
    decode pool for ``n`` tokens in ``blocks``: a smaller pool that still holds the blocks, or
    smaller blocks (padded inside each head's 32 slots) that still hold the tokens. Such a request
    is right, not wrong, and is served."""
    if type(value) is not int:
        return value == layout[key] and type(value) is type(layout[key])
    if key == "num_blocks":  # the blocks named still exist, and the pool still fits its memory
        return max(blocks) < value <= layout["regions"][0][1] // layout["block_stride"]
    if key == "tokens_per_block":  # rows still inside a head's span, enough blocks for the tokens
        return 1 <= value <= layout["head_stride"] // layout["token_stride"] and -(-n // value) <= len(blocks)
    return value == layout[key]


@st.composite
def bad_signed_requests(draw, session, layout, first_block, nblocks, tpb):
    """A request signed with the right secret (a peer we trust to hold it) that is still wrong."""
    n = draw(st.integers(1, 4 * tpb))
    need = -(-n // tpb)
    good = draw(st.lists(st.integers(first_block, nblocks - 1), min_size=need, max_size=need))
    what = draw(st.sampled_from(["outside_pool", "negative", "past_the_end", "inverted", "layout", "no_layout_geometry",
                                      "no_regions"]))
    d = _request_dict(0, session, layout, good, n)
    if what == "outside_pool":
        d["block_ids"] = good[:-1] + [draw(st.integers(nblocks, 2**31 - 1))]
    elif what == "negative":
        d["block_ids"] = good[:-1] + [draw(st.integers(-(2**31), -1))]
    elif what == "past_the_end":  # more tokens than the blocks hold
        d["token_stop"] = draw(st.integers(need * tpb + 1, 2**31 - 1))
    elif what == "inverted":
        d["token_start"], d["token_stop"] = n, draw(st.integers(0, n - 1))
    elif what == "layout":  # geometry that does not fit its own regions, overlaps itself, or nonsense
        key = draw(st.sampled_from(["num_blocks", "block_stride", "tokens_per_block", "base", "regions", "dtype",
                                    "head_dim", "kv_factor"]))
        value = draw(st.one_of(HOSTILE_VALUES, st.integers(2**40, 2**62)))
        assume(not _still_describes_the_pool(layout, key, value, good, n))
        d["layout"] = {**layout, key: value}
    elif what == "no_regions":  # the right addresses, but no memory to check them against
        d["layout"] = {**layout, "regions": []}
    else:
        d["layout"] = {k: v for k, v in layout.items() if k not in ("base", "num_blocks")}
    return d, what


def test_trusted_but_wrong_requests_are_refused_before_any_byte_moves(pair):
    """A peer holding the secret (so its seal verifies) names blocks outside the pool,
    tokens past the end, an inverted range, a broken layout or a digest algorithm the
    sender does not compute: each is refused with the
    reason, the room fails and its prefill blocks come back; the decode pool is unchanged."""
    pre, dec = pair
    endpoint = pre.ready[1]
    session, layout = dec.ready[1], dec.ready[3]
    dec.call("snap", "trusted")
    hostile = Hostile(endpoint)
    rooms = itertools.count(9000)
    sure = [  # every run tries these, besides what it draws: blocks half apart (they overlap), and a
        # pool too small for the block named
        (_request_dict(0, session, {**layout, "block_stride": layout["block_stride"] // 2}, [1], 32), "layout"),
        (_request_dict(0, session, {**layout, "num_blocks": 3}, [3], 32), "layout"),
        # a content digest by an algorithm this sender does not compute
        (_request_dict(0, session, layout, [1], 32, digest=True, digest_algorithms=["md5/x"]), "digest"),
    ]
    try:
        @PEER_FUZZ
        @given(bad_signed_requests(session, layout, 0, 64, 32))
        @example(sure[0])
        @example(sure[1])
        @example(sure[2])
        def attack(case):
            d, what = case
            room = next(rooms)
            pre.call("register", room, 16)
            d["room"] = room
            try:
                frame = _sealed(d, endpoint)
            except (TypeError, ValueError, OverflowError):
                return  # msgpack cannot carry it
            replies = hostile.exchange(frame)
            fails = [m for m in replies if isinstance(m, P.TransferFailed)]
            assert fails, (what, replies)
            assert fails[0].code in ("incompatible", "bad_message"), (what, fails)
            assert fails[0].reason
            assert what != "digest" or "'md5/x'" in fails[0].reason, fails
            logs = pre.call("logs")[1]
            # refused with the reason logged (a malformed one: counted, logged at most once a second)
            assert fails[0].code == "bad_message" or any(f"refused room {fails[0].room}" in t for _, t in logs), logs
            if fails[0].code == "incompatible":  # the room fails and gives its blocks back, once
                st_ = pre.call("state", room, 10)
                assert st_[1] == "FAILED" and st_[2], st_
            assert dec.call("changed", "trusted", [])[1] == 0

        attack()
    finally:
        hostile.close()
    assert pre.call("ping")[0] == "pong" and dec.call("ping")[0] == "pong"
    free = pre.call("free")
    assert free[2] == 0  # no block released twice


def test_out_of_order_and_cross_room_messages(pair):
    """Aborts without the secret; Done and Failed (sealed) from a peer that is not a sender;
    a request after the room succeeded; the room is served byte-exact all the same."""
    pre, dec = pair
    endpoint = pre.ready[1]
    session, layout = dec.ready[1], dec.ready[3]
    room, n = 7777, 64
    src_blocks = pre.call("register", room, n)[1]
    dst_blocks = dec.call("start_pull", room, [endpoint], n, {"deadline_s": 60})[1]
    dec.call("snap", "ooo")
    hostile = Hostile(endpoint)
    try:
        before = _refused(pre).get("control/unsigned", 0)
        for msg in [P.Abort(room=room, reason="not mine"), P.Abort(room=room + 1, reason="x")]:
            assert _only_refusals(hostile.exchange(P.encode(msg)))  # without the secret: refused unread
        assert _refused(pre)["control/unsigned"] == before + 2
        for msg in [P.TransferDone(room=room, bytes=1, segments=1, plan="direct", seconds=0.0),
                    P.TransferFailed(room=room, reason="fake", code="timeout")]:
            hostile.exchange(P.pack(msg, RING, to_prefill(endpoint)))  # a peer holding the secret, saying what only a sender may say
        logs = [t for _, t in pre.call("logs")[1]]
        for name in ("TransferDone", "TransferFailed"):  # what only a sender may say: refused by name
            assert any(t.startswith(f"sender: refused room {room} from ") and f"unexpected {name} from a decode peer" in t
                       for t in logs), (name, logs)
        pre.call("compute", room)
        state = dec.call("wait", room, 30)
        assert state[1] == "SUCCESS", state[2]  # the hostile Abort did not end someone else's room
        ok, changed = dec.call("verify", dst_blocks, n, pre.spec, src_blocks, "ooo")[1:]
        assert ok and changed == 0
        # the room is over: a request for it now (replayed with a genuine tag) moves nothing
        dec.call("snap", "after_success")
        replies = hostile.exchange(_sealed(_request_dict(room, session, layout, dst_blocks, n), endpoint))
        assert any(isinstance(m, P.TransferFailed) for m in replies), replies
        assert dec.call("changed", "after_success", [])[1] == 0
    finally:
        hostile.close()


# -- the other direction: a hostile "prefill" that a decode rank asked ---------------------------

SRC_LAYOUT = build_pool(_spec("sglang", 16, 71, blocks=256))[0].describe()


@st.composite
def hostile_answers(draw, endpoint, room, attempt):
    """Frames a hostile prefill endpoint sends back to a decode rank that asked it for ``room``."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["staged", "staged", "done", "other_room", "garbage", "failed"]))
        if kind == "garbage":
            out.append(draw(st.binary(max_size=128)))
            continue
        target = room if kind != "other_room" else draw(st.sampled_from([room + 1, 0, 2**63 - 1]))
        if kind == "failed":
            out.append(P.pack(P.TransferFailed(room=target, reason="hostile", code="transfer", attempt=attempt), RING,
                              from_prefill(endpoint)))
            continue
        staged = []
        if kind == "staged":
            for _ in range(draw(st.integers(1, 3))):
                start = draw(st.integers(0, 200))
                staged.append(P.StagedChunk(first_token=draw(st.sampled_from([0, start - start % 16, start])),
                                            start=start, stop=draw(st.integers(start, 2**31 - 1).filter(lambda x: True)),
                                            offset=draw(st.sampled_from([0, 1, 4096, 2**40])),
                                            blocks=draw(st.lists(st.integers(0, 2**31 - 1), max_size=20))))
        lay = msgspec.convert(draw(st.sampled_from([SRC_LAYOUT, {**SRC_LAYOUT, "num_blocks": 2**31},
                                                    {**SRC_LAYOUT, "head_dim": 64}])), P.LayoutDescription)
        try:
            msg = P.TransferDone(room=target, bytes=1, segments=1, plan="staged_recv", seconds=0.0, staged=staged,
                                 src_layout=lay if staged else None, attempt=attempt)
            out.append(P.pack(msg, RING, from_prefill(endpoint)))
        except P.ProtocolError:
            out.append(RING.seal(msgspec.msgpack.encode(msgspec.to_builtins(msg)), from_prefill(endpoint)))
    return out


# how a decode rank ends a room a hostile prefill answered (hostile_answers): the peer's own
# TransferFailed, a Done claiming bytes it never wrote, or staged chunks the scatter refuses
_REFUSALS = re.compile(r"^(prefill peers reported 1 B written, but the room's tokens need \d+ B"
                       r"|prefill tcp://127\.0\.0\.1:\d+ failed the room: (hostile|closing)"
                       r"|cannot scatter what prefill tcp://127\.0\.0\.1:\d+ staged: .+)$")


def test_hostile_prefill_endpoint_cannot_write_outside_the_room(pair):
    """A decode rank asks a hostile endpoint (one that holds the secret) for a room; whatever comes back (Done with
    staged chunks past the staging or the room, a lying source layout, answers for other
    rooms, garbage), the room ends with a reason or with success, its blocks come back
    once, and no byte of the decode pool outside the room's blocks changes."""
    _, dec = pair
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    rooms = itertools.count(50_000)
    try:
        @PEER_FUZZ
        @given(st.data())
        def attack(data):
            room, n = next(rooms), 64
            dec.call("snap", "hostile_prefill")
            free_before = dec.call("free")[1]
            blocks = dec.call("start_pull", room, [endpoint], n, {"deadline_s": 20})[1]
            end = time.monotonic() + REPLY_S
            while True:  # the decode rank's signed request (heartbeats may come first)
                assert router.poll(int(max(0.0, end - time.monotonic()) * 1000)), "no request from the decode rank"
                ident, payload = router.recv_multipart()
                msg = P.unpack(payload, RING, to_prefill(endpoint))  # sealed with the secret, or this raises
                if isinstance(msg, P.TransferRequest):
                    break
            assert msg.room == room and msg.block_ids == blocks
            for frame in data.draw(hostile_answers(endpoint, room, msg.attempt)):
                router.send_multipart([ident, frame])
            # the peer ends the room saying nothing of it is in flight (without that the blocks stay
            # quarantined: tests/faults/test_release_rule.py)
            router.send_multipart([ident, P.pack(P.TransferFailed(room=room, reason="closing", code="transfer",
                                                                  quiet=True, attempt=msg.attempt), RING,
                                                 from_prefill(endpoint))])
            state, reason, free = dec.call("wait", room, REPLY_S)[1:]
            # whatever it claims, a peer that wrote nothing cannot end the room Success
            assert state == "FAILED" and _REFUSALS.match(reason), (state, reason)
            assert free == free_before  # blocks back exactly once (start_pull frees them on either outcome)
            assert dec.call("changed", "hostile_prefill", blocks)[1] == 0

        attack()
    finally:
        router.close(0)
    assert dec.call("ping")[0] == "pong"
    assert dec.call("free")[2] == 0


def test_a_fake_prefill_without_the_secret_cannot_end_a_room(pair):
    """Discovery poisoned: a decode rank asks an endpoint that does not hold the secret.
    It cannot read the request's seal, and its unsigned Done with the right byte count
    (the room "succeeds with nothing written" without frame auth) is refused unread and
    counted; the room never succeeds, and ends by its deadline."""
    _, dec = pair
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        room, n = 60_001, 64
        dec.call("snap", "fake_prefill")
        before = _refused(dec).get("control/unsigned", 0)
        blocks = dec.call("start_pull", room, [endpoint], n, {"deadline_s": 3})[1]
        assert router.poll(int(REPLY_S * 1000)), "no request from the decode rank"
        ident, payload = router.recv_multipart()
        with pytest.raises(Exception):
            P.decode(payload)  # sealed: not a bare message
        dl = build_pool(_spec("trtllm", 32, 72))[0]
        need = n * dl.num_layers * dl.kv_factor * dl.token_bytes  # what the room's tokens take: a Done that adds up
        attempt = P.decode(RING.open(payload, to_prefill(endpoint))).attempt  # what its answers would echo
        for frame in (P.encode(P.TransferDone(room=room, bytes=need, segments=1, plan="direct", seconds=0.0, attempt=attempt,
                                                layer_bytes=[need // dl.num_layers] * dl.num_layers)),
                      P.encode(P.Heartbeat(room=room, sender=endpoint))):
            router.send_multipart([ident, frame])
        state, reason, _ = dec.call("wait", room, REPLY_S)[1:]
        assert state == "FAILED" and "Success" not in reason, (state, reason)
        assert _refused(dec)["control/unsigned"] >= before + 2
        assert dec.call("changed", "fake_prefill", blocks)[1] == 0
    finally:
        router.close(0)


def test_frames_sealed_for_another_link_are_refused_both_ways(pair):
    """One secret across the fleet, and each sealed frame bound to its link (direction and
    prefill rank). A decode's request captured on its way to another prefill rank and
    replayed here is refused unread: not served, not even refused as a conflict. Another
    rank's sealed answers slipped into a decode's connection to this rank (a quiet
    TransferFailed, a heartbeat from another incarnation: each would release the room's
    blocks while this rank may still write) are refused and end nothing."""
    pre, dec = pair
    session, layout = dec.ready[1], dec.ready[3]
    other = "tcp://127.0.0.1:1"  # another prefill rank holding the same secret
    room, n = 61_001, 64
    pre.call("register", room, n)
    before = _refused(pre).get("control/bad_tag", 0)
    hostile = Hostile(pre.ready[1])
    try:
        replies = hostile.exchange(_sealed(_request_dict(room, session, layout, [1, 2, 3, 4], n), other))
        assert _only_refusals(replies), replies
        assert _refused(pre).get("control/bad_tag", 0) == before + 1
    finally:
        hostile.close()
    router = zmq.Context.instance().socket(zmq.ROUTER)  # this rank, as the decode sees it
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        dec.call("snap", "other_link")
        free_before = dec.call("free")[1]
        blocks = dec.call("start_pull", room, [endpoint], n, {"deadline_s": 30})[1]
        end = time.monotonic() + REPLY_S
        while True:
            assert router.poll(int(max(0.0, end - time.monotonic()) * 1000)), "no request from the decode rank"
            ident, payload = router.recv_multipart()
            req = P.unpack(payload, RING, to_prefill(endpoint))
            if isinstance(req, P.TransferRequest):
                break
        router.send_multipart([ident, P.pack(P.Heartbeat(room=1, sender=endpoint, incarnation="a" * 16), RING,
                                             from_prefill(endpoint))])
        refused = _refused(dec).get("control/bad_tag", 0)
        for msg in (P.TransferFailed(room=room, reason="from another rank", code="aborted", quiet=True,
                                     attempt=req.attempt),
                    P.Heartbeat(room=1 << 40, sender=endpoint, incarnation="b" * 16)):
            router.send_multipart([ident, P.pack(msg, RING, from_prefill(other))])
        deadline = time.monotonic() + REPLY_S
        while _refused(dec).get("control/bad_tag", 0) < refused + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _refused(dec).get("control/bad_tag", 0) == refused + 2
        state = dec.call("wait", room, 0.5)[1]
        assert state not in ("FAILED", "SUCCESS"), state  # still waiting on this rank
        router.send_multipart([ident, P.pack(P.TransferFailed(room=room, reason="closing", code="transfer", quiet=True,
                                                              attempt=req.attempt), RING, from_prefill(endpoint))])
        state, reason, free = dec.call("wait", room, REPLY_S)[1:]
        assert state == "FAILED" and reason.endswith("failed the room: closing"), (state, reason)
        assert free == free_before and dec.call("changed", "other_link", blocks)[1] == 0
    finally:
        router.close(0)


def test_oversized_and_multi_frame_messages_to_a_real_sender(pair):
    """A 17 MiB frame is not buffered (ZMQ drops that connection); a two-frame message that
    puts someone else's routing id first is refused; the sender keeps serving others."""
    pre, _ = pair
    endpoint = pre.ready[1]
    big = Hostile(endpoint)
    spoof = Hostile(endpoint)
    fresh = Hostile(endpoint)
    try:
        pre.call("logs")
        big.sock.send(b"\x00" * (P.MAX_MESSAGE_BYTES + (1 << 20)))
        spoof.sock.send_multipart([b"\x00victim", P.pack(P.Abort(room=1, reason="as someone else"), RING, to_prefill(endpoint))])
        (reply,) = fresh.exchange(P.pack(P.Heartbeat(room=5, sender="x"), RING, to_prefill(endpoint)))
        assert (reply.room, reply.sender) == (5, endpoint) and len(reply.incarnation) == 16, reply
        logs = [t for _, t in pre.call("logs")[1]]
        assert any("2 frames, expected 1" in t for t in logs), logs
        assert not big.sock.poll(200)  # nothing came back for the oversized frame
    finally:
        for h in (big, spoof, fresh):
            h.close()
    assert pre.call("ping")[0] == "pong"
