"""`kvbridge doctor` through the CLI: what it prints about the machine is what the
machine says (sysfs and the scheduler read here directly), in JSON and as lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _sysfs_choice(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unreadable"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


def _doctor_json(threads: int, *extra: str) -> tuple[dict, dict]:
    """``kvbridge doctor --json`` with torch on ``threads`` threads (its copy calibration cached
    in a fresh directory): its notes, and the env it ran with."""
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "KVBRIDGE_CACHE_DIR": tempfile.mkdtemp(prefix="kvb-doctor-")}
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor", "--json", *extra], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout), env


def test_doctor_reports_the_machine_as_the_kernel_does():
    notes, env = _doctor_json(1)
    thp = _sysfs_choice("/sys/kernel/mm/transparent_hugepage/enabled")
    assert notes["thp"] == thp
    assert notes["cpus"] == len(os.sched_getaffinity(0))
    assert notes["omp_num_threads"] == "1" and notes["torch_threads"] == 1
    assert any("transparent huge pages" in w for w in notes["warnings"]) == (thp not in ("always", "unreadable"))
    assert any("CPU(s):" in w for w in notes["warnings"]) == (notes["cpus"] <= 2)
    # the copy floor: measured (no figure can be asserted), its warnings exactly where it exceeds a margin
    floor = notes["copy_floor"]
    assert floor["small_bytes"] == 16 << 20 and floor["big_bytes"] == 256 << 20
    assert floor["small_ms"] > 0 and floor["gbps"] > 0 and floor["cpu_s_per_gib"] >= 0
    assert any("CPU s/GiB on one thread here" in w for w in notes["warnings"]) == (floor["cpu_s_per_gib"] > 0.15)
    assert any("one copy of 16 MiB takes" in w for w in notes["warnings"]) == (floor["small_ms"] > 2.0)
    # one thread's share of the copy rate: a source past the cache, 256 MiB-1 GiB; with torch on one
    # thread (OMP_NUM_THREADS=1 here) the share cannot bound anything, so no warning
    assert 256 << 20 <= floor["share_bytes"] <= 1 << 30 and floor["threads"] == 1
    assert floor["one_thread_gbps"] > 0 and floor["all_threads_gbps"] > 0 and floor["one_thread_share"] > 0
    assert not any("threads' rate here" in w for w in notes["warnings"])

    text = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert text.returncode == 0, text.stderr[-2000:]
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"machine: THP {thp} ") and f"{notes['cpus']} CPU(s)" in lines[0]
    assert lines[1].startswith("one copy of every byte (one thread): ") and lines[1].endswith("ms for 16 MiB")
    assert lines[2].startswith("copy rate past the cache, ") and "one thread's share" in lines[2]
    # the gather's copy: this host's calibration (torch on one thread: measured on one, cached), then
    # the threads each transport gets, one with torch on one thread
    cal = notes["gather_copy"]["calibration"]
    assert cal["threads"] == 1 and cal["one_gbps"] > 0 and cal["cached"].startswith(env["KVBRIDGE_CACHE_DIR"])
    assert lines[3].startswith("gather copy, one thread ") and "cached in" in lines[3]
    assert lines[4:7] == [f"  {p}: 1 thread (torch has one thread here)" for p in ("tcp", "rdma", "nvlink")]
    # the package's C kernels, built by `make install` here: both load
    import xxhash

    assert notes["native"] == {"tile_copy": True, "digest_loop": True, "xxhash": xxhash.VERSION}
    assert lines[7] == f"C kernels: tile copy built; content digest loop built (xxhash {xxhash.VERSION})"
    assert all(line.startswith("note: ") for line in lines[8:]) or lines[8:] == ["nothing here bounds kvbridge's copies"]


def test_doctor_warns_where_one_thread_gets_too_little_of_the_copy_rate():
    """With two copy threads, the warning appears exactly where the measured share is under 0.8."""
    notes, _ = _doctor_json(2)
    floor = notes["copy_floor"]
    assert floor["threads"] == 2
    assert any("threads' rate here" in w for w in notes["warnings"]) == (floor["one_thread_share"] < 0.8)


def test_last_level_cache_sizes_read_as_sysfs_writes_them():
    from kvbridge.bench.machine import _llc_bytes

    assert _llc_bytes("L3 491520K") == 491520 << 10
    assert _llc_bytes("L3 32M") == 32 << 20
    assert _llc_bytes("L2 1048576") == 1048576
    assert _llc_bytes(None) is None and _llc_bytes("L3 big") is None


def test_doctor_reads_the_quarantine_of_a_serving_process():
    """``--metrics URL``: a process's quarantined blocks (its real /metrics endpoint, served
    by prometheus_client from kvbridge's own metrics) are listed with the peer and reason,
    and warned about; an address nothing answers at is named, not fatal."""
    from prometheus_client import CollectorRegistry, start_http_server

    from kvbridge.common.metrics import KVBridgeMetrics

    reg = CollectorRegistry()
    m = KVBridgeMetrics(reg)
    m.quarantined.labels("receiver", "tcp://10.0.0.7:5555", "aborted").inc(12)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        notes, _ = _doctor_json(1, "--metrics", url, "http://127.0.0.1:9/metrics")
    finally:
        server.shutdown()
    assert notes["quarantine"][url] == {"quarantined": [{"role": "receiver", "peer": "tcp://10.0.0.7:5555",
                                                         "reason": "aborted", "blocks": 12}]}
    assert "error" in notes["quarantine"]["http://127.0.0.1:9/metrics"]
    assert any("12 block(s) quarantined" in w and "10.0.0.7" in w for w in notes["warnings"])


def test_doctor_warns_where_a_c_kernel_is_missing(monkeypatch):
    """A package installed without a C compiler: doctor names each kernel that is missing
    and what runs instead."""
    from kvbridge.cli import _native
    from kvbridge.layout import digest, tiles

    monkeypatch.setattr(digest, "xxh3_functions", lambda: None)
    monkeypatch.setattr(tiles, "native_tile_copy", lambda: False)
    warnings: list = []
    got = _native(warnings)
    assert not got["tile_copy"] and not got["digest_loop"]
    assert len(warnings) == 2 and "torch's copies" in warnings[0] and "hash in Python" in warnings[1]
