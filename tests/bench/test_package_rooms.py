"""The rooms of the package: the core a serving process loads (``layout/``, ``common/``,
``adapters/``) holds no benchmark, report or plot code, and the layout core stays pure.

Read from the source (every import statement, wherever it sits in a module, lazily or not)
and checked once by importing, in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ("layout", "common", "adapters")
ENGINES = {"sglang", "tensorrt_llm", "vllm", "mooncake", "transformers"}
NETWORK = {"socket", "ssl", "http", "urllib", "asyncio", "selectors", "socketserver", "zmq", "aiohttp", "requests",
           "multiprocessing", "subprocess"}
BENCH_ONLY = {"matplotlib", "pytest", "hypothesis", "rich", "openai", "subprocess"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every import of a module as (absolute or dotted-relative name, line)."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            out.append(("." * n.level + (n.module or ""), n.lineno))
    return out


def _modules(room: str) -> list[Path]:
    files = sorted((ROOT / room).rglob("*.py"))
    assert files, room
    return files


@pytest.mark.parametrize("room", CORE)
def test_core_holds_no_bench_report_or_plot_module(room):
    for f in _modules(room):
        rel = f.relative_to(ROOT)
        assert not any(w in f.stem for w in ("bench", "report", "plot")), f"{rel}: belongs in bench/ (kvbridge.bench)"
        for name, line in _imports(f):
            top = name.split(".")[0]
            assert not name.startswith(("kvbridge.bench", "kvbridge.route", "kvbridge.demo", "kvbridge.cli")), \
                f"{rel}:{line} imports {name}: the core imports only kvbridge.layout, .common and .adapters"
            assert top not in BENCH_ONLY, f"{rel}:{line} imports {name}: benchmark/report/tool code belongs in bench/"


def test_layout_core_imports_no_engine_network_or_other_room():
    for f in _modules("layout"):
        rel = f.relative_to(ROOT)
        for name, line in _imports(f):
            if name.startswith("."):
                assert name.startswith(".") and not name.startswith(".."), f"{rel}:{line}: {name} leaves layout/"
                continue
            top = name.split(".")[0]
            if top == "kvbridge":
                assert name.startswith("kvbridge.layout"), f"{rel}:{line}: layout imports {name}"
                continue
            assert top not in ENGINES | NETWORK, f"{rel}:{line}: the layout core imports {name} (engine or network)"
            assert top in sys.stdlib_module_names or top in ("torch", "numpy", "xxhash"), \
                f"{rel}:{line}: the layout core imports {name} (only the standard library, torch, numpy and xxhash)"


def test_dependencies_point_adapters_to_common_to_layout():
    for f in _modules("common"):
        for name, line in _imports(f):
            assert not name.startswith("kvbridge.adapters"), f"{f.relative_to(ROOT)}:{line} imports {name}"
            assert not name.startswith(".."), f"{f.relative_to(ROOT)}:{line} imports {name}"


_PROBE = r"""
import importlib, json, pkgutil, sys
import kvbridge.layout
layout_loaded = sorted(sys.modules)
import kvbridge.common, kvbridge.adapters.sglang
for m in pkgutil.iter_modules(kvbridge.common.__path__):
    importlib.import_module("kvbridge.common." + m.name)
print(json.dumps({"layout": layout_loaded, "core": sorted(sys.modules)}))
"""


def test_importing_the_core_loads_no_engine_network_or_bench_module():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tops = {m.split(".")[0] for m in got["layout"]}
    assert not tops & (ENGINES | {"zmq", "aiohttp", "msgspec"}), sorted(tops & (ENGINES | {"zmq", "aiohttp"}))
    assert "kvbridge.common" not in got["layout"]
    core = set(got["core"])
    assert "kvbridge.common.transport" in core  # the walk imported the core's modules
    assert not {m for m in core if m.startswith("kvbridge.bench") or m.split(".")[0] in ("matplotlib", "pytest")}


def test_cli_docstring_names_every_command():
    import argparse

    import kvbridge.cli as cli

    def subcommands(parser) -> dict:
        acts = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(acts[0].choices) if acts else {}

    top = subcommands(cli.build_parser())
    assert {"demo", "bench", "report", "plan", "announce", "route"} <= set(top)
    for name, p in top.items():
        assert f"``kvbridge {name}" in cli.__doc__, name
    import re

    named = {s for m in re.findall(r"``kvbridge bench ([a-z|]+)``", cli.__doc__) for s in m.split("|")}
    assert set(subcommands(top["bench"])) == named
