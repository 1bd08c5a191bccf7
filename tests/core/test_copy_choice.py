"""The gather / scatter copy's threads per host and transport (``kvbridge.common.copy_choice``):
the rule, the per-host calibration (measured for real here, cached once, measured again when
the cache is not this host's or cannot be read), the setting that overrides it, and what
``kvbridge doctor`` shows of it."""

from __future__ import annotations

import doctest
import json
import os

import pytest

from kvbridge.common import copy_choice as cc
from kvbridge.common.settings import BridgeSettings, ConfigError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path))
    path = cc.cache_path()
    assert path.parent == tmp_path and path.name.startswith("copy-calibration-")
    return path


def _figures(one: float, all_: float, threads: int = 2):
    return lambda: {"one_gbps": one, "all_gbps": all_, "threads": threads, "measured": "now"}


def _multi_thread_host(monkeypatch):
    """``choose`` as on a host with the C copy and two torch threads (the rule, whatever this one has)."""
    monkeypatch.setattr(cc, "host_key", lambda: {"version": 1, "cpu": "x", "cpus": 2, "torch_threads": 2, "native": True})


def test_one_thread_beside_tcp_all_where_rdma_or_nvlink_leave_the_cpu_and_it_measured_faster(monkeypatch):
    _multi_thread_host(monkeypatch)
    fast, flat = _figures(10.0, 17.0), _figures(10.0, 10.5)
    asked = []

    def counted():
        asked.append(1)
        return fast()

    tcp = cc.choose("tcp", 0, counted)
    assert tcp.threads == 1 and "tcp" in tcp.reason and not asked  # TCP never needs the calibration
    for proto in ("rdma", "nvlink"):
        c = cc.choose(proto, 0, fast)
        assert c.threads == 2 and "17.0 GB/s" in c.reason and "10.0" in c.reason, c
        assert cc.choose(proto, 0, flat).threads == 1  # under GAIN: one thread is as good
    assert cc.choose("tcp", 3, fast) == cc.CopyChoice(3, "gather_threads=3 (set)")
    monkeypatch.setattr(cc, "host_key", lambda: {"version": 1, "cpu": "x", "cpus": 2, "torch_threads": 2, "native": False})
    assert cc.choose("rdma", 0, fast).threads == 1  # without the C copy torch's copies spread themselves


def test_the_host_calibration_is_measured_once_and_cached(cache):
    """Measured for real here (a small gather), written, then read back without measuring;
    a cache of another host, or one that cannot be parsed, is measured again."""
    measured = []

    def small():  # taken as on a quiet host (what a busy one does: the test below)
        measured.append(1)
        return {**cc.calibrate(tokens=512, reps=1), "others_cpu": 0.0}

    first = cc.host_calibration(measure=small)
    assert first["one_gbps"] > 0 and first["all_gbps"] > 0 and first["cached"] == str(cache)
    again = cc.host_calibration(measure=small)
    assert len(measured) == 1 and again["one_gbps"] == first["one_gbps"]
    stored = json.loads(cache.read_text())
    stored["key"]["cpu"] = "another CPU"
    cache.write_text(json.dumps(stored))
    cc.host_calibration(measure=small)
    assert len(measured) == 2
    cache.write_text("{not json")
    cc.host_calibration(measure=small)
    assert len(measured) == 3 and json.loads(cache.read_text())["key"] == cc.host_key()


# a process that spins one core for up to 60 s, saying so first (after the statement it is given)
SPIN = "import os, sys, time\n%s\nprint('spinning', flush=True)\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


def test_a_calibration_taken_beside_a_busy_process_is_used_but_not_cached(cache):
    """Measured for real beside another process spinning a core: other processes' share of
    the CPU time is counted from /proc/stat (over the whole window), the figures are given
    to the caller and nothing is written; the next call measures again. The same rule on
    reported figures: over ``BUSY`` is not cached, under it is."""
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", SPIN % ""], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline() == "spinning\n"  # before the window opens
        busy = cc.host_calibration(measure=lambda: cc.calibrate(tokens=512, reps=1))
    finally:
        hog.kill()
        hog.wait(5)
    assert busy["others_cpu"] is not None and busy["others_cpu"] > cc.BUSY, busy
    assert busy["one_gbps"] > 0 and busy["cached"] == "" and "other processes" in busy["not_cached"], busy
    assert not cache.exists()
    measured = []

    def reported(share):
        def measure():
            measured.append(share)
            return {**_figures(10.0, 17.0)(), "others_cpu": share}
        return measure

    assert cc.host_calibration(measure=reported(0.6))["cached"] == "" and not cache.exists()
    assert cc.host_calibration(measure=reported(0.05))["cached"] == str(cache)
    assert cc.host_calibration(measure=reported(0.6))["others_cpu"] == 0.05 and measured == [0.6, 0.05]


def test_others_cpu_counts_the_host_less_this_process():
    """(busy, total, own) tick counts: others' share is the busy ticks less this process's,
    over all ticks; steal counts as busy; an unknown or empty window is None."""
    assert cc.others_cpu((100, 1000, 10), (250, 1200, 60)) == 0.5
    assert cc.others_cpu((100, 1000, 10), (150, 1200, 60)) == 0.0  # all of it ours
    assert cc.others_cpu(None, (1, 2, 0)) is None and cc.others_cpu((1, 2, 0), (1, 2, 0)) is None
    before = cc._cpu_ticks()
    assert before is not None and 0 <= before[2] and before[0] <= before[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin apart")
def test_others_cpu_counts_only_the_cpus_this_process_may_run_on():
    """A process pinned to one CPU: another process spinning on a second CPU is not its
    contention (under ``BUSY``); the same process spinning on its CPU is (over it)."""
    import subprocess
    import sys

    a, b = sorted(os.sched_getaffinity(0))[:2]
    measure = ("import os, time; os.sched_setaffinity(0, {%d}); from kvbridge.common import copy_choice as cc; "
               "t = cc._cpu_ticks(); time.sleep(0.6); print(cc.others_cpu(t, cc._cpu_ticks()))")
    got = {}
    for where in (b, a):
        hog = subprocess.Popen([sys.executable, "-c", SPIN % f"os.sched_setaffinity(0, {{{where}}})"],
                               stdout=subprocess.PIPE, text=True)
        try:
            assert hog.stdout.readline() == "spinning\n"  # pinned and about to spin
            out = subprocess.run([sys.executable, "-c", measure % a], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr[-2000:]
            got[where] = float(out.stdout.strip())
        finally:
            hog.kill()
            hog.wait(5)
    assert got[b] < cc.BUSY < got[a], got


def test_a_cache_that_cannot_be_written_still_gives_the_figures(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cc.CACHE_ENV, str(blocker / "sub"))  # a directory under a file: cannot be made
    got = cc.host_calibration(measure=_figures(1.0, 2.0))
    assert got["all_gbps"] == 2.0 and got["cached"] == "" and "sub" in got["not_cached"]


def test_the_setting_reaches_every_handoff_config(cache, monkeypatch):
    """``gather_threads`` above 0 is used as set; 0 on TCP is one thread without measuring;
    0 on RDMA is this host's choice from its (cached) calibration; negative is refused."""
    assert BridgeSettings(gather_threads=2).handoff().gather_threads == 2
    assert BridgeSettings(gather_threads=2).handoff(receiver=True).gather_threads == 2
    assert BridgeSettings().handoff().gather_threads == 1 and not cache.exists()
    cache.write_text(json.dumps({"key": cc.host_key(), "figures": _figures(5.0, 20.0, threads=7)()}))
    s = BridgeSettings(protocol="rdma")
    want = 7 if cc.host_key()["native"] and cc.host_key()["torch_threads"] > 1 else 1
    assert s.handoff().gather_threads == want and s.copy_choice() is s.copy_choice()
    with pytest.raises(ConfigError, match="gather_threads"):
        BridgeSettings(gather_threads=-1)


def test_doctor_shows_the_choice_per_transport(cache, capsys, monkeypatch):
    from kvbridge.cli import main

    ticks = iter(range(0, 1 << 30, 1000))
    monkeypatch.setattr(cc, "_cpu_ticks", lambda: (0, next(ticks), 0))  # a quiet host, whatever this one does

    cache.write_text(json.dumps({"key": cc.host_key(), "figures": _figures(5.0, 20.0)()}))
    assert main(["doctor", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)
    gc = notes["gather_copy"]
    assert gc["calibration"]["all_gbps"] == 20.0 and gc["calibration"]["cached"] == str(cache)
    assert gc["choice"]["tcp"]["threads"] == 1
    assert set(gc["choice"]) == {"tcp", "rdma", "nvlink"}
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "gather copy" in out and "tcp: 1 thread" in out and "--recalibrate" in out
    # --recalibrate measures again (for real, here) and replaces the cached figures
    assert main(["doctor", "--json", "--recalibrate"]) == 0
    cal = json.loads(capsys.readouterr().out)["gather_copy"]["calibration"]
    assert cal["all_gbps"] != 20.0 and cal["one_gbps"] > 0 and "loadavg" in cal and cal["others_cpu"] == 0.0
    assert json.loads(cache.read_text())["figures"]["all_gbps"] == cal["all_gbps"]


def test_the_copy_split_example_runs():
    """The runnable example in ``CopySplit``'s docstring."""
    import kvbridge.layout.tiles as tiles

    res = doctest.testmod(tiles)
    assert res.attempted and not res.failed
