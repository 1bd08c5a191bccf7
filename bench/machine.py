"""What the machine imposes on the benchmarks' figures: read, printed, never changed.

``machine_notes()`` reads the transparent huge page policy, the CPUs this process may
run on and the cores under them, the last-level cache, the frequency governor (when readable), torch's intra-op (OpenMP) threads and
the load average (other jobs sharing the cores), and says which of them bound or blur
a figure. ``copy_floor()`` measures what one copy of every byte costs here (the floor
under any gather) and says where it alone exceeds a margin. ``spread`` gives a sample's median and p10-p90 and flags a spread wider than
the effect it is about. Used by ``kvbridge bench ...`` and ``kvbridge doctor``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

try:  # the C tile copy, built with the package (optional: pyproject's ext-modules)
    from kvbridge.layout import _tilecopy
except ImportError:  # no compiler at install time: numpy's memcpy stands in (copy_parts_one_thread)
    _tilecopy = None

__all__ = ["machine_notes", "machine_line", "spread", "copy_floor", "copy_parts_one_thread", "streamed_copy"]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _bracketed(text: str | None) -> str | None:
    """The selected value of a sysfs choice list (``always [madvise] never`` -> ``madvise``)."""
    if text is None:
        return None
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text


def _cores_and_llc(cpus: set[int]) -> tuple[int | None, str | None]:
    """Physical cores under the CPUs ``cpus`` (SMT siblings counted once) and the size
    of the last-level cache, from sysfs (None where unreadable)."""
    cores = set()
    for c in cpus:
        core = _read(f"/sys/devices/system/cpu/cpu{c}/topology/core_id")
        pkg = _read(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id")
        if core is None:
            return None, None
        cores.add((pkg, core))
    llc, level = None, -1
    for i in range(8):
        lv, size = (_read(f"/sys/devices/system/cpu/cpu{min(cpus)}/cache/index{i}/{k}") for k in ("level", "size"))
        if lv is None or size is None:
            break
        if int(lv) > level:
            level, llc = int(lv), f"L{lv} {size}"
    return len(cores), llc


def machine_notes() -> dict:
    """The machine's settings that bound kvbridge's copies, and ``warnings`` (plain
    sentences) for each one that does here."""
    import torch

    thp = _bracketed(_read("/sys/kernel/mm/transparent_hugepage/enabled"))
    defrag = _bracketed(_read("/sys/kernel/mm/transparent_hugepage/defrag"))
    try:
        allowed = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cpus = len(allowed)
    cores, llc = _cores_and_llc(allowed)
    gov = _bracketed(_read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"))
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    threads = torch.get_num_threads()
    notes = {
        "thp": thp or "unreadable",
        "thp_defrag": defrag or "unreadable",
        "cpus": cpus,
        "cores": cores if cores is not None else "unreadable",
        "llc": llc or "unreadable",
        "governor": gov or "unreadable",
        "torch_threads": threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "loadavg": load,
    }
    warn = []
    if thp and thp != "always":
        warn.append(f"transparent huge pages are '{thp}': a pool the engine did not madvise is mapped in 4 KiB pages")
    if cpus <= 2:
        warn.append(f"{cpus} CPU(s): a gather and a transfer compete for the same cores; torch's {threads} "
                    "intra-op thread(s) share them with the transport's")
    if cores is not None and cores < cpus:
        warn.append(f"{cpus} CPU(s) on {cores} core(s): SMT siblings share a core, so a second copy thread "
                    "may slow a gather down instead of helping it")
    if load is not None and load[0] > cpus:
        warn.append(f"load average {load[0]} on {cpus} CPU(s): other jobs are running; timings vary with them")
    if gov is not None and gov not in ("performance",):
        warn.append(f"CPU frequency governor '{gov}': clocks may ramp during a measurement")
    notes["warnings"] = warn
    return notes


# the margins a handoff is held to against a raw write of the same bytes
HANDOFF_CPU_MARGIN_S_PER_GIB = 0.15
SMALL_OVERHEAD_MARGIN_MS = 2.0
ONE_THREAD_SHARE_WARN = 0.8  # below it, one thread's copy rate bounds a one-thread gather's ratio to all threads'


def copy_floor(small_bytes: int = 16 << 20, big_bytes: int = 256 << 20, reps: int = 7) -> dict:
    """What ONE copy of every byte costs on this machine, on one thread, buffers warm: the
    floor under a sender's gather, which copies each byte once. ``small_ms``: the wall time
    of a ``small_bytes`` copy; ``cpu_s_per_gib``: CPU seconds per GiB of a ``big_bytes``
    copy (``gbps`` its rate); medians of ``reps``. ``warnings``: where the floor alone
    exceeds a margin kvbridge is held to (a gathering handoff cannot come within it here)."""
    out: dict = {"small_bytes": int(small_bytes), "big_bytes": int(big_bytes), "reps": reps, "how": "numpy.copyto, one thread; one_thread_share: a one-thread copy (streamed stores) against torch's on all threads, the source past the cache"}
    for key, n in (("small", small_bytes), ("big", big_bytes)):
        src = np.ones(n, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # both touched: no page faults inside the timing
        wall, cpu = [], []
        for _ in range(reps):
            c0, t0 = time.thread_time(), time.perf_counter()
            np.copyto(dst, src)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        if key == "small":
            out["small_ms"] = round(float(np.median(wall)) * 1e3, 3)
        else:
            out["gbps"] = round(n / float(np.median(wall)) / 1e9, 3)
            out["cpu_s_per_gib"] = round(float(np.median(cpu)) * (1 << 30) / n, 3)
        del src, dst
    out.update(_one_thread_share(reps))
    warn = []
    if out["cpu_s_per_gib"] > HANDOFF_CPU_MARGIN_S_PER_GIB:
        warn.append(f"one copy of every byte costs {out['cpu_s_per_gib']} CPU s/GiB on one thread here "
                    f"({out['gbps']} GB/s): a handoff that gathers (one copy of each byte) cannot stay within "
                    f"raw + {HANDOFF_CPU_MARGIN_S_PER_GIB} s/GiB on this machine")
    if out["small_ms"] > SMALL_OVERHEAD_MARGIN_MS:
        warn.append(f"one copy of {small_bytes / 2**20:g} MiB takes {out['small_ms']} ms on one thread here: "
                    f"more than the {SMALL_OVERHEAD_MARGIN_MS:g} ms a gathering small request may add to its raw "
                    "write, before any control path")
    if out["threads"] > 1 and out["one_thread_share"] < ONE_THREAD_SHARE_WARN:
        warn.append(f"one thread copies at {out['one_thread_share']} of {out['threads']} threads' rate here "
                    f"({out['all_threads_gbps']} GB/s on all): a one-thread gather (the sender's on a CPU pool) "
                    "cannot come within that share of an all-thread memcpy on this machine")
    out["warnings"] = warn
    return out


def _one_thread_share(reps: int, part: int = 16 << 20, ring_parts: int = 4) -> dict:
    """The share of the machine's copy rate one thread gets: a source twice the last-level
    cache (256 MiB-1 GiB) copied part by part into a small ring, as a sender's gather reads
    a pool, on one thread (the C copy's streamed stores, numpy's memcpy without it) and on
    all of torch's threads, interleaved; medians of ``reps``."""
    llc = _llc_bytes(_cores_and_llc(set(os.sched_getaffinity(0)))[1]) if hasattr(os, "sched_getaffinity") else None
    n = min(1 << 30, max(256 << 20, 2 * (llc or 0))) // part * part
    src = torch.ones(n, dtype=torch.uint8)
    ring = torch.ones(ring_parts * part, dtype=torch.uint8)
    threads = torch.get_num_threads()

    def one() -> None:
        copy_parts_one_thread(ring, src, part, ring_parts)

    def every() -> None:
        for k, o in enumerate(range(0, n, part)):
            ring[(k % ring_parts) * part:][:part].copy_(src[o:o + part])

    t = {one: [], every: []}
    for i in range(reps + 1):  # the first pair untimed
        for fn in (one, every) if i % 2 else (every, one):
            t0 = time.perf_counter()
            fn()
            if i:
                t[fn].append(time.perf_counter() - t0)
    return {"share_bytes": n, "threads": threads,
            "one_thread_gbps": round(n / float(np.median(t[one])) / 1e9, 3),
            "all_threads_gbps": round(n / float(np.median(t[every])) / 1e9, 3),
            "one_thread_share": round(float(np.median([e / o for e, o in zip(t[every], t[one])])), 3)}


def copy_parts_one_thread(ring: torch.Tensor, src: torch.Tensor, part: int, ring_parts: int) -> None:
    """``src`` (uint8 ``[nbytes]``) copied part by part into the regions of ``ring`` (uint8
    ``[ring_parts * part]``) in turn, on the calling thread: the C copy's streamed stores (a
    gather's), numpy's memcpy where the C copy is not built or cannot stream a part."""
    for k, o in enumerate(range(0, src.numel(), part)):
        s = src[o:o + part]
        _copy_flat(ring[(k % ring_parts) * part:][:s.numel()], s)


def _copy_flat(d: torch.Tensor, s: torch.Tensor) -> None:
    """``s`` into ``d`` on the calling thread: streamed stores, numpy's memcpy where they cannot run."""
    if not streamed_copy(d, s):
        d.numpy()[:] = s.numpy()


def copy_parts_split(ring: torch.Tensor, src: torch.Tensor, part: int, ring_parts: int, split) -> None:
    """As ``copy_parts_one_thread``, each part cut in 64 KiB-aligned slices over the threads
    of ``split`` (a ``kvbridge.layout.tiles.CopySplit``; None: one thread)."""
    if split is None:
        return copy_parts_one_thread(ring, src, part, ring_parts)
    unit = 64 << 10
    for k, o in enumerate(range(0, src.numel(), part)):
        s = src[o:o + part]
        d = ring[(k % ring_parts) * part:][:s.numel()]

        def piece(i: int, j: int, s=s, d=d) -> None:
            a, b = i * unit, min(s.numel(), j * unit)
            _copy_flat(d[a:b], s[a:b])
        split.run(piece, 0, -(-s.numel() // unit), unit)


def streamed_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy ``src`` into ``dst`` (contiguous uint8 CPU tensors, ``[nbytes]``) on the calling
    thread with the C tile copy's streamed stores, in address order: the memcpy a one-thread
    gather's order is measured against (same thread, same stores). False, nothing copied,
    where the C copy is not built or the buffers are not 16-byte aligned multiples of 16."""
    n = src.numel()
    if (_tilecopy is None or dst.numel() < n or n % 16 or src.data_ptr() % 16 or dst.data_ptr() % 16
            or src.device.type != "cpu" or dst.device.type != "cpu"):
        return False
    tile = np.array([src.data_ptr()], dtype=np.int64)  # one tile: the whole source, contiguous
    _tilecopy.tile_copy(tile.ctypes.data, 1, dst.data_ptr(), 1, 1, n, n, n, False, True)
    return True


def _llc_bytes(llc: str | None) -> int | None:
    """Bytes of a cache size as ``machine_notes`` writes it (``"L3 491520K"``); None if unreadable."""
    try:
        size = llc.split()[-1]
        return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1].upper()] if size[-1].isalpha() else int(size)
    except (AttributeError, IndexError, KeyError, ValueError):
        return None


def machine_line(notes: dict | None = None) -> str:
    """``machine_notes`` as one line."""
    n = notes or machine_notes()
    load = "/".join(str(x) for x in n["loadavg"]) if n["loadavg"] else "unreadable"
    return (f"machine: THP {n['thp']} (defrag {n['thp_defrag']}), {n['cpus']} CPU(s) on {n['cores']} core(s), "
            f"last-level cache {n['llc']}, governor {n['governor']}, "
            f"torch threads {n['torch_threads']} (OMP_NUM_THREADS {n['omp_num_threads']}), load {load}")


def spread(samples, effect_from: float | None = None, digits: int = 3) -> dict:
    """``{median, p10, p90, n}`` of ``samples``; with ``effect_from`` (e.g. 1.0 for a ratio
    of equals), ``wide``: whether p90 - p10 exceeds |median - effect_from|, the effect the
    figure reports (then the figure cannot tell the effect from noise)."""
    a = np.asarray(list(samples), dtype=float)
    if not a.size:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    out = {"median": round(float(np.median(a)), digits), "p10": round(float(np.percentile(a, 10)), digits),
           "p90": round(float(np.percentile(a, 90)), digits), "n": int(a.size)}
    if effect_from is not None:
        out["wide"] = bool(out["p90"] - out["p10"] > abs(out["median"] - effect_from))
    return out
