"""kvbridge control messages: versioned, schema-checked, msgpack on the wire.

Decode (the receiver) asks prefill (the sender) for a room's KV with a
``TransferRequest``; the sender answers ``TransferDone`` or ``TransferFailed``;
either side may send ``Heartbeat`` and ``Abort``. Every message carries the
protocol version and a ``type`` tag.

Why msgspec: it decodes straight into typed, frozen structs and checks types and
constraints (ranges, lengths) while decoding, with errors that name the offending
field (``Expected `int` >= 0 - at `$.room```); it handles tagged unions natively;
and it is fast enough that a request with millions of block ids costs
milliseconds, not seconds. ``decode`` turns every failure into ``ProtocolError``.

Auth is the frame's, not the message's: ``pack`` / ``unpack`` seal and open every
message with a ``kvbridge.common.auth.Keyring`` (HMAC-SHA256 over all of it, key ids,
a replay window); without a keyring frames are the plain encoding.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from kvbridge.layout import KVLayout

__all__ = [
    "Abort",
    "DigestPart",
    "Heartbeat",
    "LayoutDescription",
    "RankRecord",
    "StagedChunk",
    "MAX_BLOCK_IDS",
    "MAX_MESSAGE_BYTES",
    "Message",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "TransferDone",
    "TransferFailed",
    "TransferRequest",
    "decode",
    "encode",
    "pack",
    "seal",
    "unpack",
]

PROTOCOL_VERSION = 6  # 3: auth moved to the frame (kvbridge.common.auth); 4: content digests (TransferDone.digest);
# 5: the receiver names the digest algorithms it accepts (TransferRequest.digest_algorithms); 6: each request's
# attempt, echoed by every answer about it, and each frame sealed for its link (``link``)
MAX_MESSAGE_BYTES = 16 << 20
MAX_BLOCK_IDS = 1 << 24
MAX_LAYERS = 1 << 12


class ProtocolError(ValueError):
    """A control message that cannot be encoded or decoded, or is not valid."""


# Field types with their bounds.
Version = Annotated[int, Meta(ge=0, le=0xFFFF)]
Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Token = Annotated[int, Meta(ge=0, le=2**31 - 1)]
BlockId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Addr = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # user-space and device addresses fit int64
Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]
Name = Annotated[str, Meta(max_length=256)]
Code = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_.-]*$")]
Reason = Annotated[str, Meta(max_length=4096)]
Int62 = Annotated[int, Meta(ge=0, lt=2**62)]
Stride = Annotated[int, Meta(gt=0, lt=2**62)]
Dims = Union[Stride, Annotated[list[Annotated[list[Stride], Meta(min_length=2, max_length=2)]], Meta(min_length=1, max_length=8)]]
PerLayerKV = Annotated[list[Annotated[list[Int62], Meta(max_length=2)]], Meta(max_length=MAX_LAYERS)]
Endpoint = Annotated[str, Meta(min_length=7, max_length=256, pattern=r"^tcp://")]


class LayoutDescription(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A rank's KV layout as it crosses the wire or the bootstrap: ``KVLayout.describe()``'s
    fields, typed and bounded (addresses included, tensors not). ``of`` builds it from a
    layout, ``to_layout`` rebuilds the layout (``LayoutError`` if its geometry does not hold).

    >>> from kvbridge.layout import allocate_pool
    >>> lay = allocate_pool("sglang", layers=2, total_heads=2, head_dim=8, dtype="bfloat16",
    ...                     tokens_per_block=16, num_blocks=4)
    >>> d = LayoutDescription.of(lay)
    >>> d.tokens_per_block, len(d.base), d.to_layout().num_blocks
    (16, 2, 4)
    """

    engine: Name
    num_layers: Int62
    kv_factor: Int62
    num_heads: Int62
    head_offset: Int62
    total_heads: Int62
    head_dim: Int62
    dtype: Name
    tokens_per_block: Int62
    num_blocks: Int62
    first_block: Int62
    block_stride: Int62
    token_stride: Int62
    head_stride: Int62
    base: PerLayerKV  # [layer][K/V] byte address of block 0
    region_of: PerLayerKV  # [layer][K/V] index into ``regions``
    # [addr, nbytes] of the memory the rank registered: at least one, so every address the
    # map names can be checked against it before a byte moves
    regions: Annotated[list[Annotated[list[Int62], Meta(min_length=2, max_length=2)]], Meta(min_length=1, max_length=1 << 16)]
    layer_offset: Int62  # the global index of layer 0
    # per K/V: [token dims, element dims], each a stride or [[count, stride], ...] outermost first
    row_strides: Annotated[list[Annotated[list[Dims], Meta(min_length=2, max_length=2)]], Meta(max_length=2)] | None = None
    # [layer][K/V][head] fp8 dequantisation scales
    kv_scales: Annotated[list[Annotated[list[Annotated[list[float], Meta(max_length=1 << 16)]], Meta(max_length=2)]],
                         Meta(max_length=MAX_LAYERS)] | None = None

    @classmethod
    def of(cls, layout: KVLayout) -> "LayoutDescription":
        """``layout``'s description."""
        return msgspec.convert(layout.describe(), cls)

    def to_layout(self) -> KVLayout:
        """The layout this describes; ``LayoutError`` naming what does not hold."""
        return KVLayout.from_description(msgspec.to_builtins(self))

    @property
    def heads(self) -> range:
        """The global KV heads this rank holds."""
        return range(self.head_offset, self.head_offset + self.num_heads)


class RankRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a prefill rank publishes for kvbridge receivers through its bootstrap server
    (JSON there: ``msgspec.to_builtins``): its control ``endpoint``, its Mooncake
    ``session``, its ``engine``, its own block size ``page_size`` and its ``layout``."""

    version: Version = PROTOCOL_VERSION
    endpoint: Endpoint
    session: Annotated[str, Meta(min_length=1, max_length=256)]
    engine: Name
    page_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    layout: LayoutDescription

    @classmethod
    def parse(cls, obj: Any, where: str = "rank record") -> "RankRecord":
        """A record from its JSON form (extra keys of a bootstrap entry, e.g. ``tp_rank``,
        ignored); ``ProtocolError`` naming the field that is wrong."""
        if not isinstance(obj, dict):
            raise ProtocolError(f"{where}: expected a kvbridge rank record, got {type(obj).__name__}")
        try:
            return msgspec.convert({k: obj[k] for k in cls.__struct_fields__ if k in obj}, cls)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"{where}: {e}") from None


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    version: Version = PROTOCOL_VERSION
    room: Room


# which use of a room id a message belongs to: a decode rank draws one per request (random,
# never 0), every message about that request carries it, and an answer carrying another one
# (to an earlier request under the same room id) is not about this one
Attempt = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class TransferRequest(_Msg, tag="transfer_request", kw_only=True):
    """Decode -> prefill: send room ``room``'s KV tokens ``[token_start, token_stop)``
    into my blocks ``block_ids`` (entry 0 holds token ``first_token``) of ``layout``
    (``LayoutDescription``), through transfer-engine session ``session``; tokens
    before ``token_start`` I already hold. ``receivers`` is how many decode ranks ask
    for this room; ``staging_*`` name a registered staging buffer when the receiver
    scatters."""

    model: Name
    layout: LayoutDescription
    block_ids: Annotated[list[BlockId], Meta(max_length=MAX_BLOCK_IDS)]
    first_token: Token
    token_start: Token
    token_stop: Token
    session: Annotated[str, Meta(min_length=1, max_length=256)]
    receivers: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    staging_addr: Addr = 0
    staging_bytes: Count = 0
    sent_at: Seconds
    digest: bool = False  # the receiver verifies this room's content: send a digest with the Done
    # the digest algorithms it accepts, preferred first (kvbridge.layout.accepted_algorithms)
    digest_algorithms: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=4)] = []
    attempt: Attempt = 0  # this request's use of the room id: the sender's answers echo it

    def __post_init__(self) -> None:
        # Runs on construction and on decode (where msgspec reports it as a validation error).
        if not self.first_token <= self.token_start <= self.token_stop:
            raise ProtocolError(
                f"token range inverted: need first_token <= token_start <= token_stop, got "
                f"{self.first_token} <= {self.token_start} <= {self.token_stop}"
            )
        tpb = self.layout.tokens_per_block
        if tpb > 0 and self.token_stop - self.first_token > len(self.block_ids) * tpb:
            raise ProtocolError(
                f"{len(self.block_ids)} blocks (block_ids) of {tpb} tokens from token {self.first_token} cannot hold "
                f"tokens up to token_stop {self.token_stop}"
            )
        if (self.staging_addr == 0) != (self.staging_bytes == 0):
            raise ProtocolError(f"staging_addr {self.staging_addr} and staging_bytes {self.staging_bytes} must both be 0 or both be set")


AuxValue = Union[int, float, str, bool, None, list[Union[int, float]]]


class StagedChunk(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chunk the sender wrote into the receiver's staging (``staged_recv`` plans):
    tokens ``[start, stop)`` of layers ``[layer_start, layer_stop)`` (``layer_stop`` 0:
    every layer) from the sender's blocks ``blocks`` (entry 0 holds token
    ``first_token``), rows in the sender's address order at staging ``offset``."""

    first_token: Token
    start: Token
    stop: Token
    offset: Count
    blocks: Annotated[list[BlockId], Meta(max_length=MAX_BLOCK_IDS)]
    layer_start: Annotated[int, Meta(ge=0, le=MAX_LAYERS)] = 0
    layer_stop: Annotated[int, Meta(ge=0, le=MAX_LAYERS)] = 0

    def __post_init__(self) -> None:
        if self.layer_stop and self.layer_start >= self.layer_stop:
            raise ProtocolError(f"empty layer range [{self.layer_start}, {self.layer_stop})")
        if not self.layer_stop and self.layer_start:
            raise ProtocolError(f"layer_start {self.layer_start} without a layer_stop")


class DigestPart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The content digest of one piece the sender moved (``kvbridge.layout.digest``):
    global layers ``[layers[0], layers[1])``, global heads ``heads[0] ..`` (``heads[1]``
    of them), tokens ``[tokens[0], tokens[1])``, one value per unit of ``unit_tokens``
    tokens (by ``TransferDone.digest_algorithm``), in the canonical order (layer, K/V,
    head, token)."""

    layers: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_LAYERS)]], Meta(min_length=2, max_length=2)]
    heads: Annotated[list[Annotated[int, Meta(ge=0, le=1 << 16)]], Meta(min_length=2, max_length=2)]
    tokens: Annotated[list[Token], Meta(min_length=2, max_length=2)]
    unit_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    values: Annotated[list[Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]], Meta(max_length=1 << 16)]  # uint64 as int64


class TransferDone(_Msg, tag="transfer_done", kw_only=True):
    """Prefill -> decode: room ``room``'s KV has landed (``bytes`` in ``segments``
    segments, by plan ``plan``, in ``seconds``); ``layer_bytes[l]`` of them into layer
    ``l`` (the receiver admits the room only when every layer is accounted for, which
    matters once layers travel separately). ``aux`` carries what the prefill produced
    beside the KV, engine-neutral: ``output_ids`` (the first generated token(s)),
    optionally ``output_logprobs``, ``cached_tokens``..."""

    bytes: Count
    segments: Count
    plan: Annotated[str, Meta(max_length=64)]
    seconds: Seconds
    aux: Annotated[dict[Annotated[str, Meta(max_length=64)], AuxValue], Meta(max_length=32)] = {}
    # staged_recv only: the sender's layout and what it wrote where, for the receiver's scatter
    src_layout: LayoutDescription | None = None
    staged: Annotated[list[StagedChunk], Meta(max_length=1 << 16)] = []
    layer_bytes: Annotated[list[Count], Meta(max_length=MAX_LAYERS)] = []
    # asked for (TransferRequest.digest): the content of every piece moved, for the receiver to compare
    digest_algorithm: Annotated[str, Meta(max_length=64)] = ""
    digest: Annotated[list[DigestPart], Meta(max_length=1 << 12)] = []
    attempt: Attempt = 0  # the request's

    def __post_init__(self) -> None:
        if self.layer_bytes and sum(self.layer_bytes) != self.bytes:
            raise ProtocolError(f"layer_bytes sum to {sum(self.layer_bytes)}, not the {self.bytes} bytes reported")


class TransferFailed(_Msg, tag="transfer_failed", kw_only=True):
    """Either way: room ``room``'s transfer failed; ``code`` is a short machine-readable
    cause (e.g. ``layout_mismatch``, ``timeout``, ``transport``, ``auth``). From a sender,
    ``quiet`` asserts that nothing of the room is still inside its transport toward the
    decode rank it answers, and that nothing more will be written: the proof a receiver
    waits for before its blocks go back to its engine (``code="settled"``: only that)."""

    reason: Reason
    code: Code
    quiet: bool = False
    attempt: Attempt = 0  # from a sender: that of the request or Abort it answers (0: neither carried one)


class Heartbeat(_Msg, tag="heartbeat", kw_only=True):
    """Either way: ``sender`` is still working on room ``room``. A sender's reply carries
    its ``incarnation`` (fixed for the process's life): another value behind the same
    endpoint means the process that held its rooms was replaced."""

    sender: Name
    incarnation: Name = ""


class Abort(_Msg, tag="abort", kw_only=True):
    """Either way: stop room ``room``'s transfer and release its blocks (also from a
    decode rank that never asked for the room: it declined it, or the router)."""

    reason: Reason
    attempt: Attempt = 0  # from a decode rank: that of its request it ends (0: a decline, or the router)


Message = Union[TransferRequest, TransferDone, TransferFailed, Heartbeat, Abort]
_TYPES: dict[str, type] = {c.__struct_config__.tag: c for c in (TransferRequest, TransferDone, TransferFailed, Heartbeat, Abort)}


class _Envelope(msgspec.Struct):
    """What every version has in common: read first, so a version mismatch is named
    before any field of a foreign schema is judged."""

    type: str
    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_envelope = msgspec.msgpack.Decoder(_Envelope)


def decode(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message encoded in ``data``; raises ProtocolError naming what is wrong
    (garbage, truncation, wrong type or value, unknown type tag, wrong version, size)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise ProtocolError(f"message of {size} bytes exceeds the {max_bytes}-byte limit")
    try:
        env = _envelope.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"not a kvbridge message: {e}") from None
    except Exception as e:  # DecodeError, or anything a hostile input may trigger
        raise ProtocolError(f"malformed message ({size} bytes): {e}") from None
    if env.version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks kvbridge protocol version {env.version}, this side speaks version {PROTOCOL_VERSION}")
    if env.type not in _TYPES:
        raise ProtocolError(f"unknown message type {env.type[:64]!r}; known: {sorted(_TYPES)}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid {env.type} message: {e}") from None
    except Exception as e:
        raise ProtocolError(f"malformed {env.type} message: {e}") from None


def encode(msg: Message, max_bytes: int = MAX_MESSAGE_BYTES, validate: bool = True) -> bytes:
    """``msg`` as msgpack bytes; with ``validate`` it is first checked exactly as the
    peer's ``decode`` will check it, so an invalid message is refused here."""
    if not isinstance(msg, tuple(_TYPES.values())):
        raise ProtocolError(f"not a kvbridge message: {type(msg).__name__}")
    try:
        data = _encoder.encode(msg)
    except Exception as e:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {e}") from None
    if len(data) > max_bytes:
        raise ProtocolError(f"{type(msg).__name__} of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if validate:
        try:
            decode(data, max_bytes)
        except ProtocolError as e:
            raise ProtocolError(f"refusing to send an invalid message: {e}") from None
    return data


# -- sealed frames -------------------------------------------------------------------

CONTROL = b"control"  # the domain control frames are sealed for (kvbridge.common.auth), with their link


def link(prefill: str, *, to_prefill: bool) -> bytes:
    """The domain a control frame is sealed for: ``CONTROL``, its direction, and the control
    endpoint of the prefill rank at one end of its connection (what decode ranks dial,
    ``KVSender.endpoint``). A sealed frame is refused on any other connection and in the
    other direction: a frame taken off one link cannot be replayed to another prefill rank,
    nor a prefill rank's answer slipped into a decode's connection to another one.

    >>> link("tcp://10.0.0.1:18500", to_prefill=True)
    b'control\\x00to-prefill\\x00tcp://10.0.0.1:18500'
    """
    return CONTROL + (b"\x00to-prefill\x00" if to_prefill else b"\x00to-decode\x00") + prefill.encode()


def _domain(keyring, domain: bytes) -> bytes:
    if keyring is not None and not domain.startswith(CONTROL + b"\x00"):
        raise ValueError(f"a sealed control frame needs its link (protocol.link), got domain {domain!r}")
    return domain


def pack(msg: Message, keyring=None, domain: bytes = b"") -> bytes:
    """``msg`` encoded and, with a ``Keyring``, sealed for ``domain`` (``link``): what goes
    on a control socket."""
    return seal(encode(msg), keyring, domain)


def seal(data: bytes, keyring=None, domain: bytes = b"") -> bytes:
    """A message ``encode`` made, sealed with ``keyring`` for ``domain`` (``link``; as is
    without a keyring)."""
    return keyring.seal(data, _domain(keyring, domain)) if keyring is not None else data


def unpack(frame, keyring=None, domain: bytes = b"") -> Message:
    """The message in control ``frame``: with a ``Keyring``, its seal for ``domain``
    (``link``) checked first (``kvbridge.common.auth.AuthError``, before any byte of it is
    decoded), then decoded (``ProtocolError``)."""
    if keyring is not None:
        frame = keyring.open(frame, _domain(keyring, domain), MAX_MESSAGE_BYTES)
    return decode(frame)
