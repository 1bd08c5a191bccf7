"""Bounds on what a peer can make a process hold, parse or log (kvbridge.common.limits, the peer layout cache)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from kvbridge.common import protocol as P
from kvbridge.common.limits import BoundedMap, LogLimiter
from kvbridge.common.rooms import ControlSide
from kvbridge.layout import LayoutError, trtllm_layout_from_geometry


def test_bounded_map_drops_the_oldest_and_counts():
    dropped = []
    m = BoundedMap(3, name="peers", on_evict=dropped.append)
    for k in "abcde":
        m[k] = k.upper()
    assert list(m) == ["c", "d", "e"] and m.evicted == 2 and dropped == ["peers", "peers"]
    m["c"] = "again"  # an update keeps insertion order (not lru)
    m["f"] = "F"
    assert list(m) == ["d", "e", "f"]


def test_bounded_map_lru_keeps_what_is_written_to():
    m = BoundedMap(2, lru=True)
    m["a"], m["b"] = 1, 2
    m["a"] = 3  # heard from again: now the newest
    m["c"] = 4
    assert dict(m) == {"a": 3, "c": 4}


def test_log_limiter_logs_once_a_second_per_key_with_the_count(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("kvbridge.common.limits.time.monotonic", lambda: now[0])
    lim = LogLimiter(logging.getLogger("kvbridge.test"), "refused frames")
    with caplog.at_level(logging.WARNING, logger="kvbridge.test"):
        got = [lim.warn("bad_tag", "from %s", f"p{i}") for i in range(50)]
        assert lim.warn("stale", "from %s", "q")  # another key: its own budget
        now[0] += 1.0
        assert lim.warn("bad_tag", "from %s", "p50")
    assert got == [True] + [False] * 49
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["refused frames [bad_tag]: from p0", "refused frames [stale]: from q",
                    "refused frames [bad_tag] (49 more since the last): from p50"]


def test_a_peers_layout_is_parsed_once_while_it_describes_the_same_one():
    """``ControlSide._peer_layout`` (both sides: the sender's decode peers, the receiver's
    staged senders): the same description gives the same parsed layout; another one is
    parsed anew; one that fails the check is refused every time and never kept."""
    side = SimpleNamespace(_lock=threading.RLock(), _peer_layouts=BoundedMap(4, lru=True))
    one = P.LayoutDescription.of(trtllm_layout_from_geometry(1 << 30, 8, 2, 2, 2, 32, 8, "bf16"))
    two = P.LayoutDescription.of(trtllm_layout_from_geometry(1 << 31, 8, 2, 2, 2, 32, 8, "bf16"))
    first = ControlSide._peer_layout(side, "peer", one)
    assert ControlSide._peer_layout(side, "peer", P.LayoutDescription.of(first)) is first
    other = ControlSide._peer_layout(side, "peer", two)
    assert other is not first and int(other.base.min()) == 1 << 31

    def refuse(_):
        raise LayoutError("not ours")

    for _ in range(2):
        with pytest.raises(LayoutError, match="not ours"):
            ControlSide._peer_layout(side, "late", one, check=refuse)
    assert "late" not in side._peer_layouts
