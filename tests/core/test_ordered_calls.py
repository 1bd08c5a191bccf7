"""``OrderedCalls``: layer-wise sender calls run at once on CPU, and after their device
event on CUDA without holding up the caller, in the order given. The events here are
gates a test opens (``synchronize`` blocks until then), standing in for
``torch.cuda.Event``, which cannot run on this machine."""

from __future__ import annotations

import threading

from kvbridge.common.ordered_calls import OrderedCalls
from tests.helpers.peek import ordered_calls_threaded


class Gate:
    """What ``OrderedCalls`` asks of an event: ``synchronize()`` returns once it completed."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "a gate never opened"


def test_without_events_calls_run_at_once_on_the_callers_thread():
    oc = OrderedCalls("t")
    ran = []
    oc.call(lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()] and not ordered_calls_threaded(oc)
    oc.close()


def test_a_call_waits_for_its_event_and_later_calls_keep_their_order():
    oc = OrderedCalls("t")
    ran, gate, finished = [], Gate(), threading.Event()
    oc.call(lambda: ran.append("layer 0"), gate)  # returns before the event completed
    oc.call(lambda: ran.append("finish"))  # no event, but it must not overtake layer 0
    oc.call(lambda: (ran.append("after"), finished.set()))
    assert ordered_calls_threaded(oc) and ran == []
    gate.done.set()
    assert finished.wait(10)
    assert ran == ["layer 0", "finish", "after"]
    oc.close()


def test_a_failing_call_does_not_stop_the_ones_after_it():
    oc = OrderedCalls("t")
    ran, gate, finished = [], Gate(), threading.Event()
    gate.done.set()

    def boom():
        raise KeyError("room ended")

    oc.call(boom, gate)
    oc.call(lambda: (ran.append("next"), finished.set()))
    assert finished.wait(10) and ran == ["next"]
    oc.close()


def test_close_runs_what_is_queued():
    oc = OrderedCalls("t")
    ran, gate = [], Gate()
    oc.call(lambda: ran.append(1), gate)
    oc.call(lambda: ran.append(2), (gate, None))  # a tuple of events: each is waited for
    threading.Timer(0.2, gate.done.set).start()
    oc.close(timeout_s=10)
    assert ran == [1, 2]


def test_stream_event_is_recorded_on_the_stream_given_else_the_current_one(monkeypatch):
    """Both plugins' events come from ``stream_event``: recorded on the forward's stream when
    the hook names one, on the current stream otherwise (torch.cuda stood in for: no GPU here)."""
    import torch

    from kvbridge.common.ordered_calls import stream_event

    recorded = []

    class FakeEvent:
        def record(self, stream):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "current")
    assert isinstance(stream_event("forward"), FakeEvent) and isinstance(stream_event(), FakeEvent)
    assert recorded == ["forward", "current"]
