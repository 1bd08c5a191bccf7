"""Scheduler-to-worker orders: what an engine's scheduler tells each of its workers to do
with a room, one vocabulary for every plugin.

Who issues them: the plugin's scheduler half (vLLM's ``KVBridgeScheduler`` in the engine
core; TensorRT-LLM's rank-0 ``KVBridgeScheduler``). Who applies them: every worker (TP
rank), in the order issued. vLLM carries them in the connector metadata it hands each
worker every step; TensorRT-LLM in its connector metadata and on the plugin's bus
(``adapters/trtllm/bus.py``, msgpack, one ``Orders`` frame; ``seq`` numbers them there so
a rank applies each once, from whichever copy arrives first).

Prefill half: ``Open`` (blocks allocated: accept a decode rank that asks early), then
``Send`` (the prompt is computed: send it) or, layer by layer, ``SendLayers`` per forward
then ``Send``. Decode half: ``Load`` (pull the prompt into these blocks), then, where a
rank-0 decision must be the same on every rank, ``Verdict``; ``Decline`` when decode
computes the prompt itself. Either half: ``Drop`` (the request ended before its handoff
did: end the room, telling the peer).

msgspec structs: checked field by field when decoded from a wire (types, bounds, unknown
fields refused), picklable for engines that pickle their metadata.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta

__all__ = ["Order", "Open", "Send", "SendLayers", "Load", "Verdict", "Decline", "Drop",
           "ReqId", "Room", "Token", "BlockIds", "Endpoint", "EndpointList", "Reason"]

Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Seq = Annotated[int, Meta(ge=0, le=2**63 - 1)]
ReqId = Union[Annotated[int, Meta(ge=0, le=2**63 - 1)], Annotated[str, Meta(max_length=256)]]  # the engine's own id
Token = Annotated[int, Meta(ge=0, le=2**31 - 1)]
BlockIds = Annotated[list[Annotated[int, Meta(ge=0, le=2**31 - 1)]], Meta(max_length=1 << 22)]
Endpoint = Annotated[str, Meta(max_length=256)]
EndpointList = Annotated[list[Endpoint], Meta(max_length=4096)]
Reason = Annotated[str, Meta(max_length=4096)]


class _Order(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="t"):
    req: ReqId
    room: Room
    seq: Seq = 0  # the bus's numbering (0 where the carrier needs none)


class Open(_Order, tag="open", frozen=True, kw_only=True):
    """Prefill: open ``room`` for request ``req`` on its ``blocks`` (empty where the
    engine hands them over only with ``Send``); a decode rank that asks early is accepted."""

    blocks: BlockIds = msgspec.field(default_factory=list)


class Send(_Order, tag="send", frozen=True, kw_only=True):
    """Prefill: tokens ``[0, stop)`` of ``room`` are in ``blocks`` (token order); the
    sampled first token (-1: none) rides with the last message to the decode side.
    ``layered_to``: tokens ``[0, layered_to)`` were already given to forwards as
    ``SendLayers``; a worker whose own forward has not streamed them yet applies this
    order after that forward."""

    blocks: BlockIds
    stop: Token
    first_token: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1
    layered_to: Token = 0


class SendLayers(_Order, tag="send_layers", frozen=True, kw_only=True):
    """Prefill, layer by layer: this iteration's forward computes tokens ``[start, stop)``
    into ``blocks`` (entry 0 holds token 0); each worker sends each layer of them as it is
    written. About that forward only: carried in its step's metadata, never numbered."""

    blocks: BlockIds
    start: Token
    stop: Token


class Load(_Order, tag="load", frozen=True, kw_only=True):
    """Decode: pull tokens ``[start, stop)`` of ``room`` into ``blocks`` (token order,
    entry 0 holding token 0) from the prefill ranks ``endpoints`` (TP order) or the one
    ``bootstrap`` names; on failure ``on_failure`` (where the plugin decides, not the engine)."""

    blocks: BlockIds
    start: Token
    stop: Token
    endpoints: EndpointList = msgspec.field(default_factory=list)
    bootstrap: Endpoint = ""
    on_failure: Annotated[str, Meta(pattern=r"^(recompute|fail)$")] = "recompute"


class Verdict(_Order, tag="verdict", frozen=True, kw_only=True):
    """Decode: rank 0's decision for a load, the same on every rank: ``ok``, ``recompute``
    or ``fail``."""

    action: Annotated[str, Meta(pattern=r"^(ok|recompute|fail)$")]
    start: Token
    reason: Reason = ""


class Decline(_Order, tag="decline", frozen=True, kw_only=True):
    """Decode computes this prompt itself: tell each prefill rank of ``room`` to let it go."""

    endpoints: EndpointList
    reason: Reason
    label: Annotated[str, Meta(max_length=64)] = "below_break_even"


class Drop(_Order, tag="drop", frozen=True, kw_only=True):
    """Either half: request ``req`` ended before its handoff did (aborted, or its prompt
    never finished): end ``room``, telling the peer why."""

    reason: Reason = ""


Order = Union[Open, Send, SendLayers, Load, Verdict, Decline, Drop]
