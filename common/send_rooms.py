"""A sender's records of its rooms: each room (``SendRoom``), the chunks its prefill
handed over (``SendChunk``), each decode rank pulling it (``SendTarget``), and a first part
gathered before any request came (``Prestaged``). Written by ``KVSender`` (the control side)
and its send workers (``SendPipeline``), under the sender's lock."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbridge.layout import KVLayout, TransferPlan
from kvbridge.layout.repack import Gather

from . import protocol as P
from .blocks import BlockLease
from .metrics import HandoffRecord
from .rooms import RoomState

__all__ = ["Prestaged", "SendChunk", "SendRoom", "SendTarget"]


@dataclass
class SendChunk:
    """Tokens ``[start, stop)`` in ``blocks`` (entry 0 holds ``first_token``), of layers
    ``layers`` (None: every layer); ``last`` ends the room."""

    blocks: np.ndarray
    first_token: int
    start: int
    stop: int
    last: bool
    aux: dict | None = None
    layers: tuple[int, int] | None = None


@dataclass
class SendTarget:
    """One decode rank pulling a sender room: its request and how far it has been served."""

    peer: str
    request: P.TransferRequest
    remote: KVLayout
    allowed: np.ndarray
    blocks: np.ndarray  # the receiver's block ids for the room, in token order
    sent: int = 0  # chunks of the room already written to this target
    staged_bytes: int = 0  # bytes written into the receiver's staging so far
    bytes: int = 0  # payload written to this target
    segments: int = 0
    staged: list = field(default_factory=list)  # P.StagedChunk per staged_recv chunk
    layer_bytes: np.ndarray | None = None  # int64 [num_layers]: payload written into each layer
    views: dict = field(default_factory=dict)  # (first, stop) layer range -> ``remote.layer_range``
    digest: list = field(default_factory=list)  # P.DigestPart per piece moved (asked: request.digest)
    digest_algorithm: str = ""  # what digests them: of those the request accepts, the one cheapest here


@dataclass
class SendRoom:
    room: int
    deadline: float
    record: HandoffRecord
    lease: BlockLease | None = None
    state: RoomState = RoomState.BOOTSTRAPPING
    targets: dict[str, SendTarget] = field(default_factory=dict)
    expected: int = 1  # decode ranks that will pull this room (TP fan-out)
    chunks: list[SendChunk] = field(default_factory=list)
    busy: bool = False
    reason: str = ""
    plan: TransferPlan | None = None  # the latest chunk's plan; the record takes its reason when the room ends
    prestaged: Prestaged | None = None  # its first part, gathered before any request came
    prestage_tried: bool = False
    layer_cursor: tuple[int, int, int] | None = None  # layer-wise: (start, stop, next layer) of the open token range
    forgotten: bool = False  # forget() came while a send worker held the room: dropped when it lets go
    settled: bool = False  # ended, and nothing of it is in the transport any more (its decode ranks were told)
    # decode peers to tell once the room settled (refused while it may write to their session, or
    # asking after it ended) -> the attempt (protocol.Attempt) the answer is for
    watchers: dict = field(default_factory=dict)

    def note_plan_reason(self) -> None:
        """Put the latest plan's explanation into the record (built off the send's critical path)."""
        if self.plan is not None and not self.record.plan_reason:
            self.record.plan_reason = self.plan.explain()


@dataclass(frozen=True)
class Prestaged:
    """A room's first staged part, gathered after its last chunk and before any request
    came, for ``remote`` (the layout of the decode peer served last) and the request an
    engine usually sends: every token ``[0, chunk.stop)``, into ascending block ids.

    Valid for a request that matches: a staged send's staging rows are in the
    destination's address order, which block ids change only through their order (and
    a shift of all addresses not at all), so any ascending block list of any peer whose
    layout has ``remote``'s ``relative_key`` gives the same rows as ``remote``'s first
    ``nblk`` blocks (and ``gather`` goes on with the rest of the first chunk's rows)."""

    chunk: SendChunk
    remote: KVLayout
    gather: Gather  # of the plan's first chunk, its index built for rows [0, rows)
    nblk: int  # destination blocks the request needs
    nbytes: int  # the whole plan's payload
    rows: int  # staging rows gathered: rows [0, rows) of the plan's first chunk
    slot: int  # which slot of the sender's prestage buffer holds them
    addr: int  # where it starts
