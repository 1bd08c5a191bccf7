"""The scheduler-to-worker orders are one vocabulary (``kvbridge.common.orders``): the
TensorRT-LLM bus and the vLLM connector metadata carry the same structs, checked field
by field from a wire and picklable for engines that pickle their metadata."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from kvbridge.common import orders as O

EXAMPLES = [
    O.Open(req="cmpl-1", room=7),
    O.Open(req=3, room=7, blocks=[1, 2]),
    O.Send(req=3, room=7, blocks=[1, 2], stop=40, first_token=11, layered_to=32),
    O.SendLayers(req=3, room=7, blocks=[1, 2], start=0, stop=40),
    O.Load(req="cmpl-2", room=8, blocks=[5], start=0, stop=9, bootstrap="http://10.0.0.1:8998"),
    O.Load(req=4, room=8, blocks=[5], start=0, stop=9, endpoints=["tcp://10.0.0.1:1"], on_failure="fail"),
    O.Verdict(req=4, room=8, action="recompute", start=0, reason="content digest mismatch"),
    O.Decline(req=4, room=8, endpoints=["tcp://10.0.0.1:1"], reason="cheaper to compute"),
    O.Drop(req="cmpl-1", room=7, reason="decode request aborted while loading"),
]


def test_one_vocabulary_for_every_plugin():
    from kvbridge.adapters.trtllm import bus as B
    from kvbridge.adapters.vllm import scheduler as vs
    from kvbridge.adapters.vllm import worker as vw

    for name in ("Open", "Send", "SendLayers", "Load", "Verdict", "Decline", "Drop"):
        assert getattr(B, name) is getattr(O, name), name
    for mod in (vs, vw):
        for name in ("Open", "Send", "Load", "Drop"):
            assert getattr(mod, name) is getattr(O, name), (mod.__name__, name)


@pytest.mark.parametrize("order", EXAMPLES, ids=lambda o: type(o).__name__)
def test_orders_round_trip_on_a_wire_and_through_pickle(order):
    wire = msgspec.msgpack.encode(order)
    assert msgspec.msgpack.decode(wire, type=O.Order) == order
    assert pickle.loads(pickle.dumps(order)) == order


@pytest.mark.parametrize("bad, field", [
    ({"t": "load", "req": 1, "room": 2, "blocks": [-1], "start": 0, "stop": 1}, "blocks"),
    ({"t": "load", "req": 1, "room": 2, "blocks": [1], "start": 0, "stop": 1, "on_failure": "retry"}, "on_failure"),
    ({"t": "verdict", "req": 1, "room": 2, "action": "maybe", "start": 0}, "action"),
    ({"t": "send", "req": 1, "room": -2, "blocks": [], "stop": 1}, "room"),
    ({"t": "drop", "req": 1, "room": 2, "extra": True}, "extra"),
    ({"t": "open", "req": "x" * 300, "room": 2}, "req"),
])
def test_a_bad_order_is_refused_naming_the_field(bad, field):
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=O.Order)
