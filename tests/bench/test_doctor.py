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


def test_doctor_reports_the_machine_as_the_kernel_does():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    notes = json.loads(out.stdout)
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

    text = subprocess.run([sys.executable, "-m", "kvbridge.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert text.returncode == 0, text.stderr[-2000:]
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"machine: THP {thp} ") and f"{notes['cpus']} CPU(s)" in lines[0]
    assert lines[1].startswith("one copy of every byte (one thread): ") and lines[1].endswith("ms for 16 MiB")
    assert all(line.startswith("note: ") for line in lines[2:]) or lines[2:] == ["nothing here bounds kvbridge's copies"]
