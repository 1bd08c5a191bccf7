"""The shaped loopback of ``kvbridge.bench.link``: its port filters cover exactly the
range asked for (checked against the range itself), and traffic to a shaped port is
counted by the kernel's shaped class while traffic to another port is not."""

from __future__ import annotations

import socket
import subprocess
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.bench.link import LinkShapingError, ShapedLoopback, port_masks


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))
def test_port_masks_cover_exactly_the_range(a, b):
    lo, hi = min(a, b), max(a, b)
    masks = port_masks(lo, hi)
    covered = set()
    for value, mask in masks:
        assert value & ~mask & 0xFFFF == 0  # an aligned block
        size = (~mask & 0xFFFF) + 1
        block = set(range(value, value + size))
        assert not covered & block  # blocks do not overlap
        covered |= block
    assert covered == set(range(lo, hi + 1))


def test_port_masks_refuse_ports_out_of_range():
    with pytest.raises(ValueError, match="not within 0-65535"):
        port_masks(10, 70000)


def _send(port: int, n: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    got = []

    def drain():
        conn, _ = srv.accept()
        total = 0
        while total < n:
            b = conn.recv(1 << 16)
            if not b:
                break
            total += len(b)
        got.append(total)
        conn.close()

    t = threading.Thread(target=drain)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"k" * n)
    t.join(30)
    srv.close()
    assert got == [n]


def test_only_the_shaped_ports_cross_the_shaped_class():
    ports = (14500, 14503)  # outside every range the suite's servers and Mooncake use
    try:
        shaper = ShapedLoopback(400.0, ports=ports).__enter__()
    except LinkShapingError as e:
        pytest.skip(f"this host cannot shape its loopback: {e}")
    try:
        base = shaper.shaped_bytes()
        _send(14502, 1 << 20)
        shaped = shaper.shaped_bytes() - base
        assert shaped >= 1 << 20  # the payload, plus headers
        _send(14504, 1 << 20)  # one past the range
        assert shaper.shaped_bytes() - base - shaped < 1 << 16  # no payload; at most the other flow's ACKs
    finally:
        shaper.__exit__(None, None, None)
    assert subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.startswith("qdisc noqueue")


def test_a_terminated_bench_unshapes_the_loopback(tmp_path):
    """SIGTERM to a process holding the shaped loopback: it unwinds and removes the shaping."""
    import os
    import signal
    import sys
    import time

    try:
        with ShapedLoopback(400.0, ports=(14500, 14503)):
            pass
    except LinkShapingError as e:
        pytest.skip(f"this host cannot shape its loopback: {e}")
    ready = tmp_path / "ready"
    code = ("import time, pathlib\nfrom kvbridge.bench.link import ShapedLoopback\n"
            f"with ShapedLoopback(400.0, ports=(14500, 14503)):\n    pathlib.Path({str(ready)!r}).touch()\n"
            "    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 60
        while not ready.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists(), "the child never shaped the loopback"
        assert "htb" in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(30) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
        shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        if not shown.startswith("qdisc noqueue"):
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    assert shown.startswith("qdisc noqueue")
