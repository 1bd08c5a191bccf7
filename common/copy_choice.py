"""How many threads the sender's gather and the receiver's scatter copy on, per host and
per transport.

The C tile copy (``kvbridge.layout.tiles``) moves a part on one thread or, through a
``CopySplit``, on several. Which is faster depends on who else needs the CPU:

- a transport that copies through the CPU itself (TCP: the kernel's socket copies) needs
  a core beside the gather, so the gather keeps to one thread;
- a transport that does not (RDMA, NVLink: the NIC or the GPU moves the bytes) leaves
  the cores to the gather, which then takes all of them where that is measurably faster
  on this host (``GAIN``).

The host's figures come from ``calibrate`` (one thread against all of torch's threads on
the same gather of the same bytes, interleaved) run once per host and cached as JSON
under ``$KVBRIDGE_CACHE_DIR`` (default ``~/.cache/kvbridge``), keyed by the CPU model, the
CPUs this process may use and torch's threads (one file per key); a cache that does not
match is measured again. A calibration during which other processes kept more than
``BUSY`` of the CPU time of the CPUs it may run on (``others_cpu``, from ``/proc/stat``) is used by the process
that took it and not cached: the next process measures again, until one measures on a
quiet host. ``kvbridge doctor`` shows the figures and the choice per transport;
``kvbridge doctor --recalibrate`` measures again. A ``gather_threads`` setting above 0
overrides the choice.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["CopyChoice", "CACHE_ENV", "GAIN", "BUSY", "cache_path", "host_key", "calibrate", "host_calibration", "choose",
           "copy_split", "others_cpu", "threads_taken"]

log = logging.getLogger(__name__)

CACHE_ENV = "KVBRIDGE_CACHE_DIR"  # where per-host measurements are kept (default ~/.cache/kvbridge)
GAIN = 1.1  # all threads are chosen only when they copy at least this much faster than one
BUSY = 0.25  # others' share of this process's CPUs' time above which a calibration is not cached
MIN_WINDOW_S = 0.3  # others' CPU time is counted over at least this long (/proc/stat ticks at 100 Hz)
CALIBRATION_VERSION = 2  # 2: others_cpu counted, a busy calibration not cached (caches of 1 may hold one)
CPU_FREE_PROTOCOLS = ("rdma", "nvlink")  # transports whose bytes do not go through the CPU


@dataclass(frozen=True)
class CopyChoice:
    """Threads of the gather / scatter copy, and why."""

    threads: int
    reason: str


def cache_path(key: dict[str, Any] | None = None) -> Path:
    """The file the copy calibration for ``key`` (default: this process's ``host_key()``) is
    kept in: one per key, so processes with other thread counts keep their own."""
    import hashlib

    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kvbridge")
    digest = hashlib.sha256(json.dumps(key or host_key(), sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / f"copy-calibration-{digest}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def host_key() -> dict[str, Any]:
    """What a calibration holds for: the CPU model, the CPUs this process may run on,
    torch's threads, whether the C tile copy is built."""
    import torch

    from kvbridge.layout.tiles import native_tile_copy

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return {"version": CALIBRATION_VERSION, "cpu": _cpu_model(), "cpus": cpus, "torch_threads": torch.get_num_threads(),
            "native": native_tile_copy()}


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, total) clock ticks since boot of the CPUs this process may run on (its
    affinity: a pinned engine's copies compete only there), and this process's own (user +
    system, every thread); None where ``/proc/stat`` cannot be read."""
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        mine = None
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name == "cpu":  # every CPU together: the per-CPU lines follow
                    continue
                if not name.startswith("cpu"):
                    break
                if mine is not None and int(name[3:]) not in mine:
                    continue
                fields = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(fields) - fields[3] - fields[4]
                total += sum(fields)
    except (OSError, ValueError):
        return None
    if not total:
        return None
    t = os.times()
    return busy, total, round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


def others_cpu(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """Other processes' share of the CPU time of this process's CPUs between two
    ``_cpu_ticks`` (steal time, another guest's, counts as theirs); None when unknown."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy = (after[0] - before[0]) - (after[2] - before[2])
    return round(min(1.0, max(0.0, busy / (after[1] - before[1]))), 3)


def calibrate(threads: int | None = None, *, tokens: int = 8192, layers: int = 2, reps: int = 7,
              part_bytes: int = 16 << 20, ring_parts: int = 4) -> dict[str, Any]:
    """The sender's gather on one thread against the same gather over ``threads`` threads
    (default torch's): SGLang page 64 (NHD) -> TensorRT-LLM block 32 (HND), 8 KV heads x
    128 bf16, ``layers`` layers of ``tokens`` tokens (64 MiB at the defaults), part by
    part into a ring as the sender does; medians over ``reps`` interleaved repetitions
    after one untimed. Returns GB/s of each, the measurement's date, and ``others_cpu``:
    other processes' share of this process's CPUs' time while it ran (over ``MIN_WINDOW_S``
    at least)."""
    import numpy as np
    import torch

    from kvbridge.layout.plan import PlanKind, plan_transfer
    from kvbridge.layout.sglang_pool import sglang_layout_from_buffers
    from kvbridge.layout.trtllm_pool import trtllm_layout_from_geometry

    threads = threads or torch.get_num_threads()
    heads, head_dim, page, block = 8, 128, 64, 32
    pages = tokens // page + 1
    ts = [torch.zeros(pages * page, heads, head_dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
    page_bytes = page * heads * head_dim * 2
    src = sglang_layout_from_buffers([t.data_ptr() for t in ts], [t.nbytes for t in ts], [page_bytes] * len(ts),
                                     page, heads, heads, "bfloat16", tensors=ts)
    blocks = tokens // block
    dst = trtllm_layout_from_geometry(0x7F0000000000, blocks, layers, 2, heads, block, head_dim, "bfloat16")
    rng = np.random.default_rng(0)
    plan = plan_transfer(src, rng.permutation(np.arange(1, pages)), dst, rng.permutation(np.arange(blocks)), tokens,
                         force=PlanKind.STAGED_SEND)
    gather = plan.gather().prepare()
    ring = torch.empty(ring_parts * part_bytes, dtype=torch.uint8)
    step = max(1, part_bytes // gather.row_bytes)

    split, ex = copy_split(threads, "kvbridge-calibrate")

    def run(sp) -> float:
        t0 = time.perf_counter()
        for k, a in enumerate(range(0, gather.rows, step)):
            gather.run(ring[(k % ring_parts) * part_bytes:], rows=(a, min(gather.rows, a + step)), split=sp)
        return time.perf_counter() - t0

    one, all_ = [], []
    cases = [(one, None)] + ([(all_, split)] if split is not None else [])  # one thread: nothing else to measure
    start, ticks = time.monotonic(), _cpu_ticks()
    try:
        for times, sp in cases:  # untimed: first touch, threads started
            run(sp)
        for i in range(reps):  # interleaved, the order turned each repetition
            for times, sp in cases[i % len(cases):] + cases[:i % len(cases)]:
                times.append(run(sp))
    finally:
        if ex is not None:
            ex.shutdown()
    all_ = all_ or one
    time.sleep(max(0.0, start + MIN_WINDOW_S - time.monotonic()))  # a window the tick counts can tell apart
    others = others_cpu(ticks, _cpu_ticks())
    nbytes = plan.nbytes
    try:
        load = round(os.getloadavg()[0], 2)  # a busy host skews the figures: kept with them
    except OSError:
        load = None
    return {"one_gbps": round(nbytes / statistics.median(one) / 1e9, 3), "loadavg": load,
            "all_gbps": round(nbytes / statistics.median(all_) / 1e9, 3),
            "threads": threads, "bytes": nbytes, "reps": reps, "others_cpu": others,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def host_calibration(*, refresh: bool = False, path: Path | None = None,
                     measure: Callable[[], dict[str, Any]] = calibrate) -> dict[str, Any]:
    """This host's calibration: read from ``path`` (default ``cache_path()``) when it was
    taken for this ``host_key()``, else measured (``measure``) and written there unless
    other processes kept more than ``BUSY`` of the CPU time while it ran (``others_cpu``);
    either way the figures are returned (``cached``: the file, or "" with ``not_cached``
    saying why)."""
    key = host_key()
    path = path or cache_path(key)
    if not refresh:
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return {**cached["figures"], "cached": str(path)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("copy calibration %s unreadable (%s): measuring again", path, e)
    figures = measure()
    busy = figures.get("others_cpu")
    if busy is not None and busy > BUSY:
        why = (f"taken while other processes used {busy:.0%} of its CPUs' time (over {BUSY:.0%}): "
               "used by this process only, measured again by the next")
        log.warning("copy calibration not cached: %s", why)
        return {**figures, "cached": "", "not_cached": why}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "figures": figures}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("copy calibration not cached at %s: %s", path, e)
        return {**figures, "cached": "", "not_cached": f"{path}: {e}"}
    return {**figures, "cached": str(path)}


def choose(protocol: str, setting: int = 0,
           calibration: Callable[[], dict[str, Any]] = host_calibration) -> CopyChoice:
    """The gather's threads on this host for ``protocol``: ``setting`` when above 0, else
    one beside a transport that needs the CPU, else all of them where ``calibration``
    says they copy at least ``GAIN`` times faster than one."""
    if setting > 0:
        return CopyChoice(setting, f"gather_threads={setting} (set)")
    key = host_key()
    if not key["native"]:
        return CopyChoice(1, "the C tile copy is not built here: torch's copies spread themselves")
    if key["torch_threads"] < 2:
        return CopyChoice(1, "torch has one thread here")
    if protocol not in CPU_FREE_PROTOCOLS:
        return CopyChoice(1, f"{protocol}: the transport's own copies need a core beside the gather")
    cal = calibration()
    one, all_, n = cal["one_gbps"], cal["all_gbps"], cal["threads"]
    measured = f"{n} threads {all_} GB/s against one {one} GB/s (calibrated {cal.get('measured', '?')})"
    if all_ >= GAIN * one:
        return CopyChoice(n, f"{protocol}: the transport leaves the CPU to the gather; {measured}")
    return CopyChoice(1, f"{protocol}: all threads are not {GAIN}x one here; {measured}")


def copy_split(threads: int, name: str):
    """A ``CopySplit`` over ``threads`` threads and the executor its owner shuts down, or
    ``(None, None)`` for one thread."""
    if threads <= 1:
        return None, None
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.layout.tiles import CopySplit

    ex = ThreadPoolExecutor(threads - 1, thread_name_prefix=name)
    return CopySplit(threads, ex), ex


def threads_taken(split) -> int:
    """The most threads a copy on the calling thread ran on since last asked (``CopySplit.taken``),
    at least one: what a handoff record's ``copy_threads`` keeps."""
    return max(split.taken() if split is not None else 0, 1)
