"""The gather / scatter copy's threads per host and transport (``kvbridge.common.copy_choice``):
the rule, the per-host calibration (measured for real here, cached once, measured again when
the cache is not this host's or cannot be read), the setting that overrides it, and what
``kvbridge doctor`` shows of it."""

from __future__ import annotations

import doctest
import json

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

    def small():
        measured.append(1)
        return cc.calibrate(tokens=512, reps=1)

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


def test_a_cache_that_cannot_be_written_still_gives_the_figures(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cc.CACHE_ENV, str(blocker / "sub"))  # a directory under a file: cannot be made
    got = cc.host_calibration(measure=_figures(1.0, 2.0))
    assert got["all_gbps"] == 2.0 and got["cached"] == ""


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


def test_doctor_shows_the_choice_per_transport(cache, capsys):
    from kvbridge.cli import main

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
    assert cal["all_gbps"] != 20.0 and cal["one_gbps"] > 0 and "loadavg" in cal
    assert json.loads(cache.read_text())["figures"]["all_gbps"] == cal["all_gbps"]


def test_the_copy_split_example_runs():
    """The runnable example in ``CopySplit``'s docstring."""
    import kvbridge.layout.tiles as tiles

    res = doctest.testmod(tiles)
    assert res.attempted and not res.failed
