"""An emulated slower link for benches: Linux traffic control (``tc``) on the loopback.

Every bench here runs its peers on one host over 127.0.0.1, where a transfer is 5-300x
faster than a CPU forward. ``ShapedLoopback`` puts an HTB rate limit on the TCP traffic
to Mooncake's listeners (ports 15000-17000; the servers' own ports are drawn from
17100-21999, the kernel's ephemeral ones from 32768 up), so the KV crosses a link of the
given rate while the control traffic (HTTP, ZMQ, bootstrap) does not wait behind it.
It is the kernel's own shaper, on the real sockets: the writes, their completions and
the peers' CPU are what they would be on a link of that rate (without its latency).

It changes the host's loopback for every process while it is up, so it needs
``CAP_NET_ADMIN`` (root), refuses when the loopback already has a root qdisc of its
own, and removes what it added on exit. Never use it in a test.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading

__all__ = ["MOONCAKE_PORTS", "ShapedLoopback", "LinkShapingError", "port_masks"]

log = logging.getLogger(__name__)

MOONCAKE_PORTS = (15000, 17000)  # the range Mooncake's TCP transport listens in (docs/security.md), inclusive
_DEV = "lo"


class LinkShapingError(RuntimeError):
    """The loopback could not be shaped (no ``tc``, no permission, a qdisc already there)."""


def port_masks(lo: int, hi: int) -> list[tuple[int, int]]:
    """The (value, mask) pairs whose union is exactly the ports ``lo..hi`` (inclusive):
    aligned power-of-two blocks, as u32 filters match them."""
    if not 0 <= lo <= hi <= 0xFFFF:
        raise ValueError(f"port range {lo}-{hi} is not within 0-65535")
    out = []
    while lo <= hi:
        size = lo & -lo if lo else 1 << 16
        while size > hi - lo + 1:
            size >>= 1
        out.append((lo, 0xFFFF & ~(size - 1)))
        lo += size
    return out


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise LinkShapingError(f"tc {' '.join(args)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


class ShapedLoopback:
    """TCP to ``ports`` on the loopback limited to ``rate_mbit`` megabits per second while
    the context is open; ``set_rate`` changes it in place."""

    def __init__(self, rate_mbit: float, ports: tuple[int, int] = MOONCAKE_PORTS):
        if not rate_mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {rate_mbit}")
        self.rate_mbit = float(rate_mbit)
        self.ports = ports
        self._up = False
        self._sigterm = None

    @staticmethod
    def _class_args(rate_mbit: float) -> list[str]:
        burst = max(256 << 10, int(rate_mbit * 1e6 / 8 * 2e-3))  # 2 ms of the rate, at least 4 of lo's 64 KiB frames
        rate = f"{rate_mbit:.3f}mbit"
        return ["htb", "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst)]

    def __enter__(self) -> "ShapedLoopback":
        if shutil.which("tc") is None:
            raise LinkShapingError("no tc on this host (iproute2): the link cannot be shaped")
        shown = _tc("qdisc", "show", "dev", _DEV).stdout
        if shown.strip() and not shown.lstrip().startswith("qdisc noqueue"):
            raise LinkShapingError(f"{_DEV} already has a qdisc ({shown.strip().splitlines()[0]}); not replacing it")
        _tc("qdisc", "add", "dev", _DEV, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
        self._up = True
        try:
            _tc("class", "add", "dev", _DEV, "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
            _tc("class", "add", "dev", _DEV, "parent", "1:", "classid", "1:20", *self._class_args(self.rate_mbit))
            for value, mask in port_masks(*self.ports):
                _tc("filter", "add", "dev", _DEV, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", "protocol", "6", "0xff", "match", "ip", "dport", str(value), hex(mask),
                    "flowid", "1:20")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if threading.current_thread() is threading.main_thread():  # a SIGTERM unwinds through __exit__
            self._sigterm = signal.signal(signal.SIGTERM, _terminated)
        log.info("loopback shaped: TCP to ports %d-%d at %.1f Mbit/s", *self.ports, self.rate_mbit)
        return self

    def set_rate(self, rate_mbit: float) -> None:
        """The shaped class's rate, changed without touching the filters."""
        if not rate_mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {rate_mbit}")
        _tc("class", "change", "dev", _DEV, "parent", "1:", "classid", "1:20", *self._class_args(rate_mbit))
        self.rate_mbit = float(rate_mbit)
        log.info("loopback shaped: now %.1f Mbit/s", rate_mbit)

    def shaped_bytes(self) -> int:
        """Bytes the shaped class has sent so far (from ``tc -s class show``)."""
        out = _tc("-s", "class", "show", "dev", _DEV, "classid", "1:20").stdout
        for line in out.splitlines():
            parts = line.split()
            if parts[:1] == ["Sent"]:
                return int(parts[1])
        return 0

    def __exit__(self, *exc) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self._up:
            _tc("qdisc", "del", "dev", _DEV, "root", check=False)
            self._up = False
            log.info("loopback shaping removed")
